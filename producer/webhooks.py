"""Completion webhooks (docs/pipelines/job-life.md): a job that names a ``webhook`` URL gets a signed
POST there once it ends.

- **Who may be called**: ``check_url`` allows only a host an operator listed (``webhook_hosts``) and,
  unless ``webhook_private`` is on, only when every address the host resolves to is public (no loopback,
  private, link-local or reserved range), so a caller cannot make the server probe its own network. The
  producers (``Client``, ``AsyncClient``, the gateway) check at submit; the sender checks again at send.
- **Signing**: the Standard Webhooks convention: ``webhook-id`` (the job id: the same on every retry, the
  receiver's de-duplication key), ``webhook-timestamp`` (epoch seconds) and ``webhook-signature``
  ``v1,<base64 HMAC-SHA256 over "id.timestamp.body">``, with the secret of the API key that submitted
  the job (``GlobalKeys.webhook_secrets``, set by ``mlxq keys webhook-secret``).
- **Delivery**: ``WebhookSender`` (``mlxq webhooks run``) reads each model's ``webhooks`` set (job id ->
  the time its next attempt is due), posts the summary of each job that has ended, and on a failure
  (no 2xx, an error, a URL no longer allowed) schedules the next attempt after a backoff with full jitter,
  up to ``webhook_max_attempts``. Every attempt is recorded in ``webhook_log`` (``mlxq webhooks list``).
  Delivery is at least once: run one sender per deployment (two would each deliver).
- **Bulk runs** (an OpenAI batch, a ``Client.map``) name a URL too: when the run ends, its producer queues
  the run's summary (``bulk_webhook_writes``: the message, fixed then, in ``GlobalKeys.bulk_webhook_log``
  and due in ``bulk_webhooks``), and the same sender signs, posts, retries and records it as a job's, with
  the run id as ``webhook-id`` and the secret of the key that made the run.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import ipaddress
import json
import logging
import secrets
import socket
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Callable, Optional
from urllib.parse import urlsplit

from ..shared.apikeys import copy_field
from ..shared.keys import GlobalKeys, ModelKeys
from ..shared.linkwatch import Backoff
from ..shared.settings import Settings
from .records import TERMINAL, record_fields, result_from_hash

log = logging.getLogger("mlxq.webhooks")

SECRET_PREFIX = "whsec_"
SEND_TIMEOUT_S = 10.0
FIRST_RETRY_S, MAX_RETRY_S = 1.0, 600.0  # the backoff between attempts: from 1 s, doubling, capped at 10 min


class WebhookRefused(ValueError):
    """A webhook URL mlxq will not call (off the allowlist, a private address, not http(s))."""


def allowed_hosts(settings: Settings) -> set[str]:
    return {h.strip().lower() for h in (settings.webhook_hosts or "").split(",") if h.strip()}


def check_url(url: str, settings: Settings, resolve: Callable = socket.getaddrinfo) -> None:
    """Raise ``WebhookRefused`` (one line saying why) unless ``url`` may be called: http or https, a host
    on ``webhook_hosts``, and (unless ``webhook_private``) every address it resolves to public."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise WebhookRefused(f"webhook {url!r:.100} is not an http(s) URL with a host")
    if parts.username or parts.password:
        raise WebhookRefused("a webhook URL may not carry credentials (user:password@)")
    host = parts.hostname.lower()
    hosts = allowed_hosts(settings)
    if host not in hosts:
        listed = ", ".join(sorted(hosts)) or "none (set webhook_hosts)"
        raise WebhookRefused(f"webhook host {host!r} is not allowed; the operator allows: {listed}")
    if settings.webhook_private:
        return
    try:
        infos = resolve(host, parts.port or (443 if parts.scheme == "https" else 80), proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError) as exc:
        raise WebhookRefused(f"webhook host {host!r} does not resolve ({exc})") from None
    for info in infos:
        addr = ipaddress.ip_address(info[4][0].split("%", 1)[0])
        if not addr.is_global or addr.is_multicast:
            raise WebhookRefused(f"webhook host {host!r} resolves to {addr}, a loopback, private or reserved "
                                 "address (an operator may allow those with webhook_private)")


def new_secret() -> str:
    """A Standard Webhooks secret: ``whsec_`` and 24 random bytes in base64."""
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(24)).decode()


def sign(secret: str, msg_id: str, timestamp: int, body: bytes) -> str:
    """The ``webhook-signature`` header: ``v1,<base64 HMAC-SHA256(key, "id.timestamp.body")>``, the key
    being the secret's bytes after ``whsec_`` (base64-decoded)."""
    key = base64.b64decode(secret[len(SECRET_PREFIX):] if secret.startswith(SECRET_PREFIX) else secret)
    mac = hmac.new(key, f"{msg_id}.{timestamp}.".encode() + body, hashlib.sha256).digest()
    return "v1," + base64.b64encode(mac).decode()


def summary(model: str, job_id: str, record: dict) -> dict:
    """The body posted: the job's id, model, status and result summary (never its text: a receiver reads
    that with the job id, as any client does)."""
    status = record.get("status", b"").decode()
    res = result_from_hash(job_id, record)
    data = {"id": job_id, "model": model, "status": status}
    if res is not None:
        data.update(finish_reason=res.finish_reason, error=res.error,
                    usage={"prompt_tokens": res.stats.prompt_tokens, "completion_tokens": res.stats.generated_tokens})
    return {"type": f"job.{status}", "timestamp": int(time.time()), "data": data}


def bulk_summary(kind: str, run_id: str, status: str, counts: dict, **extra) -> dict:
    """The body posted when a bulk run ends: ``<kind>.<status>`` (OpenAI's own batch events are named
    ``batch.completed``, ``batch.failed``, ``batch.cancelled``, ``batch.expired``) and the run's summary:
    its id, status, ``request_counts`` and ``extra`` (a batch's output and error file ids)."""
    return {"type": f"{kind}.{status}", "timestamp": int(time.time()),
            "data": {"id": run_id, "object": kind, "status": status, "request_counts": counts, **extra}}


def bulk_webhook_writes(gkeys: GlobalKeys, run_id: str, url: str, key_hash: Optional[str],
                        message: dict) -> list[tuple[str, str, tuple]]:
    """The writes that queue a bulk run's webhook, as (key, command, args), for a sync or an async client
    (on a cluster, the client of the key's slot): the log entry that holds the message first, then its
    due time (0: at once), so the sender never finds one without the other.  ``key_hash``: the run's
    creator (its secret signs); None for none."""
    entry = json.dumps({"url": url, "whk": copy_field(key_hash) if key_hash else "anonymous", "body": message,
                        "attempts": 0, "state": "pending"})
    return [(gkeys.bulk_webhook_log, "hset", (gkeys.bulk_webhook_log, run_id, entry)),
            (gkeys.bulk_webhooks, "zadd", (gkeys.bulk_webhooks, {run_id: 0}))]


@dataclass
class Attempt:
    ok: bool
    detail: str  # the HTTP status, or the error


def post(url: str, headers: dict, body: bytes, timeout: float = SEND_TIMEOUT_S) -> Attempt:
    req = urllib.request.Request(url, data=body, method="POST", headers={"content-type": "application/json", **headers})
    try:
        with _NO_REDIRECTS.open(req, timeout=timeout) as resp:
            return Attempt(200 <= resp.status < 300, f"HTTP {resp.status}")
    except urllib.error.HTTPError as exc:
        return Attempt(False, f"HTTP {exc.code}")
    except (OSError, ValueError) as exc:
        return Attempt(False, f"{type(exc).__name__}: {exc}"[:200])


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """A redirect is not followed: it could lead off the allowlist (it reads as a failed attempt)."""

    def redirect_request(self, *args, **kwargs):
        return None


_NO_REDIRECTS = urllib.request.build_opener(_NoRedirect)


class WebhookSender:
    """Deliver the webhooks of ended jobs, for every model served (``GlobalKeys.models``) or ``models``."""

    def __init__(self, redis, settings: Settings, models: Optional[list[str]] = None,
                 send: Callable[[str, dict, bytes], Attempt] = post, check: Callable = check_url,
                 bulk: Optional[bool] = None):
        self.redis, self.settings = redis, settings
        self.gkeys = GlobalKeys(settings.prefix)
        self.models = models
        # bulk runs belong to no model: delivered by the sender of every model unless asked, so that senders
        # split by --queue do not each deliver them
        self.bulk = models is None if bulk is None else bulk
        self.send, self.check = send, check

    def _models(self) -> list[str]:
        if self.models is not None:
            return self.models
        return sorted(m.decode() if isinstance(m, bytes) else m for m in self.redis.hkeys(self.gkeys.models))

    def run_once(self, limit: int = 100) -> int:
        """One pass: every due delivery of every model tried once; returns the number delivered."""
        jobs = sum(self._model_pass(ModelKeys(m, self.settings.prefix), limit) for m in self._models())
        return jobs + (self._bulk_pass(limit) if self.bulk else 0)

    def run(self, stop, interval_s: float = 0.5) -> None:
        """Pass after pass until ``stop`` (a threading.Event) is set."""
        while not stop.is_set():
            try:
                self.run_once()
            except Exception:  # noqa: BLE001 - a lost link or a bad record: the next pass tries again
                log.exception("webhook pass failed; trying again")
            stop.wait(interval_s)

    def _model_pass(self, k: ModelKeys, limit: int) -> int:
        sec, usec = self.redis.time()
        now = sec + usec / 1e6  # the set's times are the server's (the enqueue script's own)
        due = self.redis.zrangebyscore(k.webhooks, "-inf", now, 0, limit)
        delivered = 0
        for raw in due:
            job_id = raw.decode() if isinstance(raw, bytes) else raw
            record = record_fields(self.redis.hgetall(k.job(job_id)))
            status = record.get("status", b"").decode()
            if not record:  # its record expired or was deleted: nothing to report
                self.redis.zrem(k.webhooks, job_id)
            elif status in TERMINAL:
                delivered += self._deliver(k, job_id, record, now)
        return delivered

    def _bulk_pass(self, limit: int) -> int:
        sec, usec = self.redis.time()
        now = sec + usec / 1e6
        g = self.gkeys
        delivered = 0
        for raw in self.redis.zrangebyscore(g.bulk_webhooks, "-inf", now, 0, limit):
            run_id = raw.decode() if isinstance(raw, bytes) else raw
            entry = self.redis.hget(g.bulk_webhook_log, run_id)
            if entry is None:  # its log expired: nothing to send
                self.redis.zrem(g.bulk_webhooks, run_id)
                continue
            entry = json.loads(entry)
            delivered += self._attempt(g.bulk_webhooks, g.bulk_webhook_log, run_id, entry["url"], entry["whk"],
                                       lambda e=entry: e["body"], now)
        return delivered

    def _deliver(self, k: ModelKeys, job_id: str, record: dict, now: float) -> int:
        return self._attempt(k.webhooks, k.webhook_log, job_id, record.get("webhook", b"").decode(),
                             record.get("whk", b"anonymous").decode(), lambda: summary(k.model, job_id, record), now)

    def _attempt(self, due_key: str, log_key: str, msg_id: str, url: str, whk: str, message: Callable[[], dict],
                 now: float) -> int:
        """One attempt at one webhook: checked, signed with ``whk``'s secret, sent, recorded in ``log_key``
        and, unless delivered or out of attempts, due again in ``due_key`` after a backoff."""
        entry = json.loads(self.redis.hget(log_key, msg_id) or b"{}")
        entry.update(url=url, attempts=entry.get("attempts", 0) + 1)
        secret = self.redis.hget(self.gkeys.webhook_secrets, whk)
        try:
            self.check(url, self.settings)
            if secret is None:
                raise WebhookRefused("no webhook secret for the job's API key (mlxq keys webhook-secret)")
        except WebhookRefused as exc:
            result = Attempt(False, f"refused: {exc}")
        else:
            body = json.dumps(message(), separators=(",", ":")).encode()
            ts = int(time.time())
            headers = {"webhook-id": msg_id, "webhook-timestamp": str(ts),
                       "webhook-signature": sign(secret.decode(), msg_id, ts, body)}
            result = self.send(url, headers, body)
        entry.update(last=result.detail, at=time.time())
        pipe = self.redis.pipeline(transaction=False)
        if result.ok or entry["attempts"] >= self.settings.webhook_max_attempts:
            entry["state"] = "delivered" if result.ok else "failed"
            pipe.zrem(due_key, msg_id)
        else:
            entry["state"] = "retrying"
            backoff = Backoff(FIRST_RETRY_S, MAX_RETRY_S)
            backoff.failures = entry["attempts"] - 1
            pipe.zadd(due_key, {msg_id: now + backoff.fail()})
        pipe.hset(log_key, msg_id, json.dumps(entry))
        pipe.expire(log_key, self.settings.result_ttl_s)  # kept as long as results, after the last write
        pipe.execute()
        log.info("webhook of %s: attempt %d, %s (%s)", msg_id, entry["attempts"], entry["state"], result.detail)
        return int(result.ok)


def deliveries(redis, k: ModelKeys) -> list[dict]:
    """Every recorded delivery of one model: job id, url, attempts, state, last result, time."""
    return _rows(redis, k.webhook_log)


def bulk_deliveries(redis, gkeys: GlobalKeys) -> list[dict]:
    """Every recorded (or pending) delivery of a bulk run's webhook, as ``deliveries`` (``job``: the run id)."""
    return _rows(redis, gkeys.bulk_webhook_log)


def _rows(redis, log_key: str) -> list[dict]:
    rows = [{"job": (j.decode() if isinstance(j, bytes) else j),
             **{f: v for f, v in json.loads(v).items() if f not in ("body", "whk")}}
            for j, v in redis.hgetall(log_key).items()]
    return sorted(rows, key=lambda r: r.get("at") or 0)
