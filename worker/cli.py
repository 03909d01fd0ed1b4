"""``mlxq worker``: run one MLX worker process for one model."""

from __future__ import annotations

import argparse
import logging
import os
import sys

log = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from mlxq.producer.cliopts import add_shared

    add_shared(p, "redis_url", "model", required=("model",), help={"model": "an mlx-lm model directory or hub id"})
    p.add_argument("--name", help="the queue name (default: the model directory's base name or the hub id)")
    p.add_argument("--max-batch", type=int, default=None,
                   help="most sequences decoded together (default: as many as the KV memory holds)")
    p.add_argument("--attention", choices=("auto", "fused", "gather"), default=os.environ.get("MLXQ_ATTENTION"),
                   help="auto (the fused CPU op when it builds, else gather), fused, or gather "
                        "(default: $MLXQ_ATTENTION, else auto)")
    p.add_argument("--kv-memory-mb", type=float, default=None, help="KV block pool budget in MiB (default 512)")
    p.add_argument("--kv-blocks", type=int, default=None,
                   help="a fixed number of 32-token KV blocks (default: as many as --kv-memory-mb holds)")
    p.add_argument("--session-dir", default=None,
                   help="where session KV is written under pressure and at shutdown (default: not written)")
    p.add_argument("--keep-dtype", action="store_true",
                   help="keep quantized/bf16 weights (on the CPU they are converted to fp32 by default)")
    p.add_argument("--grace", type=float, default=30.0, help="warm-shutdown grace period in seconds")
    p.add_argument("--burst", action="store_true", help="exit when the queue is empty")
    p.add_argument("--rq-queues", default=None,
                   help="also take jobs from these rq queues (comma-separated, e.g. mlxq-high,mlxq-normal,mlxq-low; "
                        "see mlxq.worker.rq_bridge) (default: none)")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus metrics on this port (default: no metrics server)")
    p.add_argument("--metrics-host", default="127.0.0.1",
                   help="the address the metrics server binds: loopback; 0.0.0.0 exposes it on every interface "
                        "(for a Prometheus on another host)")


def make_engine(args, loaded):
    from .runner import make_engine as _make

    budget = int(args.kv_memory_mb * 2**20) if args.kv_memory_mb else None
    return _make(loaded, max_batch=args.max_batch, kv_memory_bytes=budget, num_blocks=args.kv_blocks,
                 session_dir=args.session_dir,
                 attention=getattr(args, "attention", None))


def run(args) -> int:
    from mlxq.producer.client import connect
    from mlxq.shared.settings import Settings

    from .model import ModelNotFound, load_model
    from .runner import Worker

    if not args.redis_url:
        raise SystemExit("mlxq worker: no Redis URL (pass --redis-url or set MLXQ_REDIS_URL)")
    # (the BLAS in use is logged once, in the worker's "serving" line)
    settings = Settings.from_env(redis_url=args.redis_url)
    try:
        loaded = load_model(args.model, name=args.name, keep_dtype=args.keep_dtype)
    except ModelNotFound as exc:
        print(f"mlxq worker: {exc}", file=sys.stderr)
        return 2
    observers, bridge = [], None
    redis_client = connect(args.redis_url)
    if getattr(args, "metrics_port", None):
        from mlxq.shared.keys import GlobalKeys

        from .metrics import WorkerMetrics

        metrics = WorkerMetrics(redis_client, GlobalKeys(settings.prefix).model_keys(loaded.name), loaded.name)
        metrics.serve(args.metrics_port, getattr(args, "metrics_host", "127.0.0.1"))
        observers.append(metrics)
    if getattr(args, "rq_queues", None):
        from .rq_bridge import RqBridge

        queues = tuple(q.strip() for q in args.rq_queues.split(",") if q.strip())
        bridge = RqBridge(redis_client, loaded.name, settings, queues)
        observers.append(bridge)
    worker = Worker(redis_client, loaded, settings, engine=make_engine(args, loaded),
                    grace_s=args.grace, observers=observers)
    worker.install_signal_handlers()
    if bridge is not None:
        bridge.start()
    try:
        worker.run(burst=args.burst)
    finally:
        if bridge is not None:
            bridge.stop()
    return 0
