"""``mlxq gateway``: the OpenAI-compatible HTTP gateway (:mod:`mlxq.producer.gateway`).

Its settings flags are generated from :class:`mlxq.shared.settings.Settings`, as the worker's are:
each is also set by ``MLXQ_<NAME>``; a flag wins over the environment, the environment over the default.
"""

from __future__ import annotations

from ..shared.settings import gateway_flags
from .options import add_setting_flags, add_shared, deprecated_alias, settings_from


def cmd_gateway(args) -> int:
    from ..producer.gateway import create_app  # first: without the gateway extra, the one line that says so

    import uvicorn

    # (the log format is set for every command by the CLI's start: shared/logs.py)
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
    p.add_argument("--access-log", action="store_true", help="uvicorn's per-request access log")
    add_setting_flags(p.add_argument_group("settings", "also set by their MLXQ_* variables"), gateway_flags())
    deprecated_alias(p, "--no-worker-wait", "no_worker_wait_s", type=float)
    p.set_defaults(func=cmd_gateway)
