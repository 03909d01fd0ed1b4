"""The helpers most tests import: a worker run on its own thread (every MLX call of the worker on
that thread), settings that make a worker react fast, waiting on a condition, tier clients, a raw POST
to a gateway, and the neutral working directory of every subprocess the tests start."""

from __future__ import annotations

import atexit
import contextlib
import http.client
import json
import shutil
import tempfile
import threading
import time
from urllib.parse import urlparse

import redis

from mlxq.shared.settings import Settings

_NEUTRAL: list[str] = []


def neutral_cwd() -> str:
    """An empty working directory for subprocesses (``python -m mlxq ...``): Python puts the cwd first
    on ``sys.path``, and a checkout's root would shadow the installed ``mlxq`` with its own ``mlxq/``
    (which lacks the mapped ``producer``/``worker``/``shared``).  Made once, removed at exit."""
    if not _NEUTRAL:
        _NEUTRAL.append(tempfile.mkdtemp(prefix="mlxq-tests-cwd-"))
        atexit.register(shutil.rmtree, _NEUTRAL[0], True)
    return _NEUTRAL[0]


def fast_settings(url: str, **kw) -> Settings:
    base = dict(redis_url=url, gather_ms=2.0, idle_block_s=0.2, heartbeat_s=0.5, lease_s=5.0, stats_interval_s=0.2)
    base.update(kw)
    # a live worker on a loaded machine is not judged dead at 2.5 beats of 0.5 s (a test that measures
    # the takeover sets its own)
    base.setdefault("takeover_s", max(3.0, 2.5 * base["heartbeat_s"]))
    return Settings(**base)


@contextlib.contextmanager
def running_worker(loaded, url: str, settings: Settings | None = None, **kw):
    """A Worker serving on its own thread until the block ends (then a warm stop)."""
    from mlxq.worker.runner import Worker

    settings = settings or fast_settings(url)
    w = Worker(redis.Redis.from_url(url), loaded, settings, **kw)
    t = threading.Thread(target=w.run, name="test-worker", daemon=True)
    t.start()
    try:
        yield w
    finally:
        w.request_stop(grace_s=0)
        t.join(timeout=30)
        assert not t.is_alive(), "worker did not stop"


@contextlib.contextmanager
def serving_gateway(loaded, url: str, settings_kw: dict | None = None, **worker_kw):
    """An emptied Redis at ``url``, a worker serving ``loaded`` (its ``name``) and the gateway in front
    of it, for the block: yields (the gateway's URL, a Redis client).  ``settings_kw``: settings of both."""
    from mlxq.producer.gateway import ServerThread, create_app
    from mlxq.shared.keys import GlobalKeys

    r = redis.Redis.from_url(url)
    r.flushall()
    settings = fast_settings(url, **(settings_kw or {}))
    try:
        with running_worker(loaded, url, settings, **worker_kw):
            assert wait_for(lambda: r.hexists(GlobalKeys().models, loaded.name), timeout=60)
            with ServerThread(create_app(url, settings)) as gateway_url:
                yield gateway_url, r
    finally:
        r.close()


def tier_clients(url: str, settings: Settings, tag: str):
    """(admin, low, high): clients whose registered API keys (suffix ``tag``) put their jobs in the
    normal, low and high tiers (once keys exist, a key-less client is refused)."""
    from mlxq import Client
    from mlxq.shared import apikeys
    from mlxq.shared.keys import GlobalKeys

    admin = Client(url, api_key=f"key-norm-{tag}", model="tiny", settings=settings)
    reg = GlobalKeys().api_keys
    apikeys.add_key(admin.redis, reg, f"key-norm-{tag}", "normal")
    apikeys.add_key(admin.redis, reg, f"key-high-{tag}", "high")
    apikeys.add_key(admin.redis, reg, f"key-low-0{tag}", "low")
    low = Client(url, api_key=f"key-low-0{tag}", model="tiny", settings=settings)
    high = Client(url, api_key=f"key-high-{tag}", model="tiny", settings=settings)
    return admin, low, high


@contextlib.contextmanager
def model_without_worker(url: str, model: str):
    """A Redis client on ``url`` with ``model`` registered as a live worker registers it (alive for the
    test's length): producers and the gateway take its jobs, which wait (no worker runs them)."""
    from mlxq.shared import codec
    from mlxq.shared.keys import GlobalKeys

    client = redis.Redis.from_url(url)
    client.hset(GlobalKeys().models, model, codec.pack({"name": model, "context_length": 4096,
                                                        "max_token_bytes": 8, "seen_at": 4e9}))
    try:
        yield client
    finally:
        client.close()


def wait_for(pred, timeout=10.0, interval=0.02):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(interval)
    return False


def job_fields(r, key: str) -> dict:
    """A job record's fields by name, a finished one's tier, worker and times included."""
    from mlxq.producer.records import record_fields

    return record_fields(r.hgetall(key))


def raw_post(url: str, path: str, body, headers=None, timeout=30) -> tuple[int, dict]:
    """POST ``body`` (JSON, or bytes as they are) to a gateway: (status, the JSON answer)."""
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn.request("POST", path, data, {"Content-Type": "application/json", **(headers or {})})
    resp = conn.getresponse()
    out = resp.status, json.loads(resp.read() or b"null")
    conn.close()
    return out


def publish_deltas(q, items: list, client=None):
    """What the worker's publisher sends for a step's deltas: the fenced append + publish of each
    (job id, owner, payload, seq); returns the job keys whose lease was lost (with a pipeline as
    ``client``: its reply)."""
    return q.run(q.calls.deltas(items), client)


def read_published(entries: list):
    """What an n == 1 job (sample 0) published, read from its durable record's entries."""
    from mlxq.worker.jobs import Published, read_samples

    return read_samples(entries).get(0) or Published()
