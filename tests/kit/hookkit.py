"""A webhook receiver on loopback and the Standard Webhooks check, written from the rule (not with
mlxq's signing code): for the tests of job and bulk-run webhooks."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Receiver(BaseHTTPRequestHandler):
    replies: list[int] = []  # the status of each request in turn (200 once they run out)
    got: list[tuple[dict, bytes]] = []

    def do_POST(self):  # noqa: N802 - http.server's name
        body = self.rfile.read(int(self.headers["content-length"]))
        type(self).got.append(({k.lower(): v for k, v in self.headers.items()}, body))
        self.send_response(self.replies.pop(0) if self.replies else 200)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


@contextlib.contextmanager
def receiving(replies: list[int]):
    """A receiver on loopback for the block, answering ``replies`` in turn (then 200): yields its URL;
    what it got is in ``Receiver.got``."""
    Receiver.replies, Receiver.got = list(replies), []
    server = ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/hooks/mlxq"
    finally:
        server.shutdown()
        server.server_close()


def verify(secret: str, headers: dict, body: bytes) -> bool:
    """Standard Webhooks: base64(HMAC-SHA256(base64decode(secret after whsec_), "id.timestamp.body"))."""
    key = base64.b64decode(secret.removeprefix("whsec_"))
    signed = f"{headers['webhook-id']}.{headers['webhook-timestamp']}.".encode() + body
    expected = base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()).decode()
    return any(hmac.compare_digest(sig.split(",", 1)[1], expected)
               for sig in headers["webhook-signature"].split() if sig.startswith("v1,"))
