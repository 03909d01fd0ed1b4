"""``mlxq dashboard``: the operator's pages (:mod:`mlxq.producer.dashboard`) on their own port.

It binds loopback by default, where its pages are open to whoever reaches that port and its actions
need an admin key once keys exist (as `mlxq jobs` does). Bound to any other address, every page needs
a login with an admin key, and it will not start while no admin key is registered. The gateway serves
the same pages at /dashboard, always behind the login.
"""

from __future__ import annotations

import ipaddress

from .options import add_shared

DEFAULT_PORT = 8089


def loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve anywhere
        return False


def cmd_dashboard(args) -> int:
    from ..producer.dashboard import create_dashboard  # first: without the extra, the one line that says so

    import uvicorn

    from ..producer.client import connect
    from ..shared import apikeys
    from ..shared.keys import GlobalKeys
    from ..shared.settings import Settings

    settings = Settings.from_env(redis_url=args.redis_url)
    login_required = not loopback(args.host)
    if login_required:
        r = connect(args.redis_url, settings.redis_outage_s)
        if not any(k["admin"] and not k["revoked"] for k in apikeys.list_keys(r, GlobalKeys(settings.prefix))):
            raise ValueError(f"on {args.host} the dashboard needs an admin key to log in with, and none is registered: "
                             "`mlxq keys create --name NAME --tier high --admin` makes one (or bind 127.0.0.1)")
    app = create_dashboard(args.redis_url, settings, login_required=login_required)
    print(f"mlxq dashboard: http://{args.host}:{args.port}/" + (" (admin key login)" if login_required else ""))
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", log_config=None)
    return 0


def add_commands(sub) -> None:
    p = sub.add_parser("dashboard", help="the operator's pages: queues, workers, plots, jobs, batches, keys")
    add_shared(p, "redis_url")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on; any but loopback requires an admin key login")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help="port to listen on")
    p.set_defaults(func=cmd_dashboard)
