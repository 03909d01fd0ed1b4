"""Shared fixtures: a real Valkey server the tests start themselves, the tiny local model,
and a worker run on its own thread (every MLX call of the worker on that thread)."""

from __future__ import annotations

import contextlib
import os
import threading
import time

# The suite runs its own process, worker subprocesses and Valkey on the same cores at once: the
# case where OpenBLAS's spinning idle threads hurt (see mlxq.worker.blas.default_threads), so the
# tests' workers (which inherit this environment) use one BLAS thread unless told otherwise.
os.environ.setdefault("MLXQ_BLAS_THREADS", "1")

from mlxq.worker import blas  # noqa: E402

blas.setup()  # the fast BLAS under MLX, as in the worker: before any test module imports mlx

import pytest
import redis

from mlxq.shared.embedded import EmbeddedRedis
from mlxq.shared.settings import Settings, cache_dir


@pytest.fixture(scope="session")
def redis_server():
    server = EmbeddedRedis().start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server):
    r = redis.Redis.from_url(redis_server.url)
    r.flushall()
    r.close()
    return redis_server.url


@pytest.fixture
def fake_redis():
    import fakeredis

    return fakeredis.FakeRedis()


@pytest.fixture(scope="session")
def tiny_model_seed() -> int:
    """The seed the tiny model is trained from ($MLXQ_TEST_MODEL_SEED, default 0).  Its weights also
    follow the machine's BLAS and CPU kernels: no test may depend on which text they produce."""
    from mlxq.devkit.make_model import seed_from_env

    return seed_from_env()


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_model_seed):
    from mlxq.devkit.make_model import ensure_model, seeded_dir

    return ensure_model(seeded_dir(cache_dir(), "tiny", tiny_model_seed), "tiny", seed=tiny_model_seed)


@pytest.fixture(scope="session")
def tiny_model(tiny_model_dir):
    from mlxq.worker.model import load_model

    return load_model(str(tiny_model_dir), name="tiny")


def fast_settings(url: str, **kw) -> Settings:
    base = dict(redis_url=url, gather_ms=2.0, idle_block_s=0.2, heartbeat_s=0.5, lease_s=5.0, stats_interval_s=0.2)
    base.update(kw)
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


def tier_clients(url: str, settings: Settings, tag: str):
    """(admin, low, high): a key-less client and clients whose registered API keys (suffix ``tag``)
    put their jobs in the low and high tiers."""
    from mlxq import Client
    from mlxq.shared import apikeys
    from mlxq.shared.keys import GlobalKeys

    admin = Client(url, model="tiny", settings=settings)
    reg = GlobalKeys().api_keys
    apikeys.add_key(admin.redis, reg, f"key-high-{tag}", "high")
    apikeys.add_key(admin.redis, reg, f"key-low-0{tag}", "low")
    low = Client(url, api_key=f"key-low-0{tag}", model="tiny", settings=settings)
    high = Client(url, api_key=f"key-high-{tag}", model="tiny", settings=settings)
    return admin, low, high


def wait_for(pred, timeout=10.0, interval=0.02):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(interval)
    return False
