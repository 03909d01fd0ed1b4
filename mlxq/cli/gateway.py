"""``mlxq gateway``: the OpenAI-compatible HTTP gateway (:mod:`mlxq.producer.gateway`).

Its settings flags are generated from :class:`mlxq.shared.settings.Settings`, as the worker's are:
each is also set by ``MLXQ_<NAME>``; a flag wins over the environment, the environment over the default.
"""

from __future__ import annotations

import os

from ..shared.settings import flags
from .options import add_setting_flags, add_shared, deprecated_alias, settings_from

# the Settings fields a gateway reads (the rest are the worker's and the engine's)
GATEWAY_FIELDS = ("prefix", "no_worker_wait_s", "live_worker_s", "redis_outage_s", "max_prompt_bytes",
                  "submit_replica_ack_ms", "idempotency_ttl_s")


def gateway_flags():
    return flags(GATEWAY_FIELDS)


def cmd_gateway(args) -> int:
    import uvicorn

    from ..producer.gateway import create_app, use_json_logs

    if args.log_format == "json":
        use_json_logs()
    settings = settings_from(args, gateway_flags())
    app = create_app(args.redis_url, settings)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info", access_log=args.access_log,
                log_config=None)
    return 0


def add_commands(sub) -> None:
    p = sub.add_parser("gateway", help="OpenAI-compatible HTTP gateway (chat/completions, models, metrics)")
    add_shared(p, "redis_url")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for every interface)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument("--log-format", choices=("text", "json"), default=os.environ.get("MLXQ_LOG_FORMAT", "text"),
                   help="text, or one JSON object per line with job and attempt fields ($MLXQ_LOG_FORMAT)")
    p.add_argument("--access-log", action="store_true", help="uvicorn's per-request access log")
    add_setting_flags(p.add_argument_group("settings", "also set by their MLXQ_* variables"), gateway_flags())
    deprecated_alias(p, "--no-worker-wait", "no_worker_wait_s", type=float)
    p.set_defaults(func=cmd_gateway)
