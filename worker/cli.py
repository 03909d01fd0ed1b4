"""``mlxq worker``: run one MLX worker process for one model."""

from __future__ import annotations

import argparse
import logging
import os

log = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--redis-url", default=os.environ.get("MLXQ_REDIS_URL"), help="default: $MLXQ_REDIS_URL")
    p.add_argument("--model", required=True, help="an mlx-lm model directory or hub id")
    p.add_argument("--name", help="the queue name (default: the model directory's base name or the hub id)")
    p.add_argument("--max-batch", type=int, default=None,
                   help="most sequences decoded together (dense default 64; paged default: set by KV memory)")
    p.add_argument("--engine", choices=("dense", "paged"), default="dense",
                   help="dense: mlx-lm BatchGenerator with a solo fast path; paged: 32-token KV blocks")
    p.add_argument("--attention", choices=("auto", "fused", "gather"), default=os.environ.get("MLXQ_ATTENTION"),
                   help="paged engine: auto (the fused CPU op when it builds, else gather), fused, or gather "
                        "(default: $MLXQ_ATTENTION, else auto)")
    p.add_argument("--kv-memory-mb", type=float, default=None, help="paged engine: KV pool budget in MiB")
    p.add_argument("--kv-blocks", type=int, default=None, help="paged engine: a fixed number of 32-token blocks")
    p.add_argument("--session-dir", default=None,
                   help="paged engine: where session KV is written under pressure and at shutdown")
    p.add_argument("--keep-dtype", action="store_true",
                   help="keep quantized/bf16 weights (on the CPU they are converted to fp32 by default)")
    p.add_argument("--grace", type=float, default=30.0, help="warm-shutdown grace period in seconds")
    p.add_argument("--burst", action="store_true", help="exit when the queue is empty")
    p.add_argument("--rq-queues", default=None,
                   help="also take jobs from these rq queues (comma-separated, e.g. mlxq-high,mlxq-normal,mlxq-low; "
                        "see mlxq.worker.rq_bridge)")
    p.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics on this port")


def make_engine(args, loaded):
    if args.engine == "paged":
        from .paged.engine import PagedEngine

        budget = int(args.kv_memory_mb * 2**20) if args.kv_memory_mb else None
        return PagedEngine(loaded.model, memory_budget_bytes=budget, num_blocks=args.kv_blocks,
                           max_batch=args.max_batch, eos_token_ids=loaded.eos_token_ids,
                           model_id=loaded.name, session_dir=args.session_dir,
                           attention=getattr(args, "attention", None))
    from .engine import DenseEngine

    return DenseEngine(loaded.model, eos_token_ids=loaded.eos_token_ids, max_batch=args.max_batch or 64)


def run(args) -> int:
    from mlxq.producer.client import connect
    from mlxq.shared.settings import Settings

    from . import BLAS_STATUS
    from .model import load_model
    from .runner import Worker

    if not args.redis_url:
        raise SystemExit("mlxq worker: no Redis URL (pass --redis-url or set MLXQ_REDIS_URL)")
    log.info("BLAS: %s", BLAS_STATUS)
    settings = Settings.from_env(redis_url=args.redis_url)
    loaded = load_model(args.model, name=args.name, keep_dtype=args.keep_dtype)
    observers, bridge = [], None
    redis_client = connect(args.redis_url)
    if getattr(args, "metrics_port", None):
        from mlxq.shared.keys import GlobalKeys

        from .metrics import WorkerMetrics

        metrics = WorkerMetrics(redis_client, GlobalKeys(settings.prefix).model_keys(loaded.name), loaded.name)
        metrics.serve(args.metrics_port)
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
