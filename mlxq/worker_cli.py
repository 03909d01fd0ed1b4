"""``mlxq worker``: run one MLX worker process for one model.

Its flags are generated from :class:`mlxq.shared.settings.Settings` (one per worker and engine field,
each also set by ``MLXQ_<NAME>``): a flag wins over the environment, the environment over the default.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading

from .shared.settings import Settings, worker_flags

log = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from .shared.cliopts import add_setting_flags, add_shared

    add_shared(p, "redis_url", "model", required=("model",), help={"model": "an mlx-lm model directory, a hub id, or a GGUF file"})
    p.add_argument("--name", help="the queue name (default: the model directory's base name, the GGUF file's "
                                  "stem, or the hub id)")
    add_setting_flags(p, worker_flags())


def settings_from_args(args) -> Settings:
    """The worker's settings: ``MLXQ_*`` from the environment, each flag given on the command line over it."""
    from .shared.cliopts import given_settings

    return Settings.from_env(redis_url=args.redis_url, log_format=getattr(args, "log_format", None),
                             **given_settings(args, worker_flags()))


def run(args) -> int:
    from .producer.client import connect

    if not args.redis_url:
        raise SystemExit("mlxq worker: no Redis URL (pass --redis-url or set MLXQ_REDIS_URL)")
    try:
        settings = settings_from_args(args)
    except ValueError as exc:  # a bad value: said before anything loads
        print(f"mlxq worker: {exc}", file=sys.stderr)
        return 2
    log.info("settings: %s", settings.describe())

    from .worker import blas

    blas.setup()  # the fast BLAS under MLX, before anything imports MLX (logged in the "serving" line)
    from .worker.engine.engine import make_engine
    from .worker.model import ModelNotFound, load_model
    from .worker.runner import Worker

    try:
        loaded = load_model(args.model, name=args.name, keep_dtype=settings.keep_dtype)
    except ModelNotFound as exc:
        print(f"mlxq worker: {exc}", file=sys.stderr)
        return 2
    observers, bridge, metrics = [], None, None
    redis_client = connect(args.redis_url)
    if settings.metrics_port:
        from .shared.keys import GlobalKeys

        from .worker.metrics import WorkerMetrics

        metrics = WorkerMetrics(redis_client, GlobalKeys(settings.prefix).model_keys(loaded.name), loaded.name)
        observers.append(metrics)
    if settings.rq_queues:
        from .producer.rq_bridge import RqBridge

        queues = tuple(q.strip() for q in settings.rq_queues.split(",") if q.strip())
        bridge = RqBridge(redis_client, loaded.name, settings, queues)
        observers.append(bridge)
    worker = Worker(redis_client, loaded, settings, engine=make_engine(loaded, settings), observers=observers)
    if metrics is not None:
        # /health and /ready beside /metrics, from the worker's own watchdog; with no metrics port a
        # worker has no HTTP endpoint: a stuck one exits (code 70) for its supervisor to restart it
        from .worker.health import WorkerHealth

        metrics.serve(settings.metrics_port, settings.metrics_host, health=WorkerHealth.of(worker))
    if os.environ.get("MLXQ_TEST_FREEZE_STEP"):
        _freeze_at_step(worker.engine, int(os.environ["MLXQ_TEST_FREEZE_STEP"]))
    worker.install_signal_handlers()
    if bridge is not None:
        bridge.start()
    try:
        worker.run(burst=settings.burst)
    finally:
        if bridge is not None:
            bridge.stop()
        if metrics is not None:
            metrics.shutdown()  # and hands its queue-depth lease on
    return 0


def _freeze_at_step(engine, n: int) -> None:
    """A test hook (``MLXQ_TEST_FREEZE_STEP=n``): the engine's n-th step never returns, as a hung
    kernel's would, so that a test sees the worker's watchdog notice it (tests/test_takeover.py)."""
    step, count = engine.step, [0]

    def frozen_step():
        count[0] += 1
        if count[0] >= n:
            log.warning("MLXQ_TEST_FREEZE_STEP: step %d never returns", count[0])
            threading.Event().wait()
        return step()

    engine.step = frozen_step
