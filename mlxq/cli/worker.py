"""``mlxq worker``: run one MLX worker process for one model.

Its flags are generated from :class:`mlxq.shared.settings.Settings` (one per worker and engine field,
each also set by ``MLXQ_<NAME>``): a flag wins over the environment, the environment over the default.
``--help`` shows them in groups (:data:`GROUPS`).
"""

from __future__ import annotations

import argparse
import logging
import sys

from ..shared.settings import Settings, worker_flags
from .options import add_setting_flags, add_shared, deprecated_alias, settings_from

log = logging.getLogger(__name__)

# ``mlxq worker --help`` groups its flags by what they tune; a field named in none (a new one) is listed
# under "other" until it is placed here.
GROUPS = {
    "engine": ("keep_dtype", "cpu_weights", "max_batch", "step_token_budget", "chunked_prefill", "chunk_schedule",
               "priority_gap", "attention", "matmul", "host_thread", "embed_pooling", "speculate", "speculate_k",
               "draft_model"),
    "memory": ("kv_memory_mb", "kv_blocks", "block_size", "pressure", "prefix_cache", "decode_reserve_blocks",
               "max_sequences", "max_waiting", "session_dir", "kv_bits", "kv_group_size", "huge_pages"),
    "queue": ("prefix", "tier_offsets", "max_queued_per_tier", "lease_s", "heartbeat_s", "takeover_s",
              "max_attempts", "result_ttl_s", "gather_ms", "idle_block_s", "max_new_tokens", "grace_s", "burst",
              "rq_queues"),
    "observability": ("metrics_port", "metrics_host", "stats_interval_s", "series_interval_s", "stall_s", "log_format"),
}
GROUP_HELP = {
    "engine": "how the engine runs the model: batching, prefill, attention and matmul kernels",
    "memory": "the KV block pool: its size, quantization and prefix cache",
    "queue": "the queue it serves: leases, heartbeats, retries, tier offsets",
    "observability": "metrics, stats and the stuck-step watchdog",
    "other": None,
}


def group_of(name: str) -> str:
    return next((g for g, names in GROUPS.items() if name in names), "other")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_shared(p, "redis_url", "model", "queue", required=("model",),
               help={"model": "the model: an mlx-lm model directory, a GGUF file or a hub id",
                     "queue": "the queue it serves (default: the model's name: the directory's base name, "
                              "the GGUF file's stem, or the hub id)"})
    deprecated_alias(p, "--name", "queue")
    by_group: dict[str, list] = {}
    for f in worker_flags():
        by_group.setdefault(group_of(f.name), []).append(f)
    for group in (*GROUPS, "other"):
        if by_group.get(group):
            add_setting_flags(p.add_argument_group(group, GROUP_HELP[group]), by_group[group])


def settings_from_args(args) -> Settings:
    """The worker's settings: ``MLXQ_*`` from the environment, each flag given on the command line over it."""
    return settings_from(args, worker_flags())


def run(args) -> int:
    from .. import worker as _needs_the_extra  # noqa: F401 - without it, the one line that says so, first
    from ..producer.client import connect

    if not args.redis_url:
        raise SystemExit("mlxq worker: no Redis URL (pass --redis-url or set MLXQ_REDIS_URL)")
    try:
        settings = settings_from_args(args)
    except ValueError as exc:  # a bad value: said before anything loads
        print(f"mlxq worker: {exc}", file=sys.stderr)
        return 2
    log.info("settings: %s", settings.describe())

    from ..worker import blas

    blas.setup()  # the fast BLAS under MLX, before anything imports MLX (logged in the "serving" line)
    from ..worker.engine.engine import make_engine
    from ..worker.model import ModelNotFound, load_model
    from ..worker.runner import Worker

    try:
        loaded = load_model(args.model, name=args.queue, keep_dtype=settings.keep_dtype,
                            cpu_weights=settings.cpu_weights)
    except ModelNotFound as exc:
        print(f"mlxq worker: {exc}", file=sys.stderr)
        return 2
    observers, bridge, metrics = [], None, None
    redis_client = connect(args.redis_url, settings.redis_outage_s)
    if settings.metrics_port:
        from ..shared.keys import GlobalKeys

        from ..worker.metrics import WorkerMetrics

        metrics = WorkerMetrics(redis_client, GlobalKeys(settings.prefix).model_keys(loaded.name), loaded.name)
        observers.append(metrics)
    if settings.rq_queues:
        from ..producer.rq_bridge import RqBridge

        queues = tuple(q.strip() for q in settings.rq_queues.split(",") if q.strip())
        bridge = RqBridge(redis_client, loaded.name, settings, queues)
        observers.append(bridge)
    worker = Worker(redis_client, loaded, settings, engine=make_engine(loaded, settings), observers=observers)
    if metrics is not None:
        # /health and /ready beside /metrics, from the worker's own watchdog; with no metrics port a
        # worker has no HTTP endpoint: a stuck one exits (code 70) for its supervisor to restart it
        from ..worker.health import WorkerHealth

        metrics.serve(settings.metrics_port, settings.metrics_host, health=WorkerHealth.of(worker))
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


def add_commands(sub) -> None:
    p = sub.add_parser("worker", help="run an MLX worker for one model")
    add_arguments(p)
    p.set_defaults(func=run)
