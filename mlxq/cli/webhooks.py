"""``mlxq webhooks``: deliver completion webhooks (``run``) and show their deliveries (``list``)."""

from __future__ import annotations

import json
import threading
from datetime import datetime, timezone

from ..shared.settings import Settings
from .options import add_shared


def cmd_webhooks(args) -> int:
    from ..producer.client import connect
    from ..producer.webhooks import WebhookSender, bulk_deliveries, deliveries
    from ..shared.keys import GlobalKeys

    settings = Settings.from_env()
    r = connect(args.redis_url, settings.redis_outage_s)
    gk = GlobalKeys(settings.prefix)
    models = [args.queue] if getattr(args, "queue", None) else None
    if args.action == "run":
        stop = threading.Event()
        try:
            WebhookSender(r, settings, models).run(stop, args.interval)
        except KeyboardInterrupt:
            stop.set()
        return 0
    names = models or sorted(m.decode() for m in r.hkeys(gk.models))
    rows = [{"model": m, **row} for m in names for row in deliveries(r, gk.model_keys(m))]
    if not models:  # bulk runs' (an OpenAI batch's, a Client.map's): of no one model
        rows += [{"model": "-", **row} for row in bulk_deliveries(r, gk)]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    for row in rows:
        when = datetime.fromtimestamp(row.get("at") or 0, timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
        print(f"{row['job']}  {row['model']:12} {row.get('state', '?'):9} attempts={row.get('attempts', 0)} "
              f"{when}  {row.get('last', '')}  {row.get('url', '')}")
    return 0


def add_commands(sub) -> None:
    p = sub.add_parser("webhooks", help="deliver completion webhooks (run), or list their deliveries")
    add_shared(p, "redis_url")
    ws = p.add_subparsers(dest="action", required=True)
    run = ws.add_parser("run", help="deliver the webhooks of ended jobs and bulk runs (OpenAI batches, Client.map), "
                                    "signed, with retries (one per deployment)")
    add_shared(run, "redis_url", "queue", help={"queue": "only this model's jobs (default: every model served, and "
                                                         "bulk runs)"})
    run.add_argument("--interval", type=float, default=0.5, help="seconds between passes (default: 0.5)")
    ls = ws.add_parser("list", help="every recorded delivery: job (or bulk run), state, attempts, last result, URL")
    add_shared(ls, "redis_url", "queue", help={"queue": "only this model's deliveries (default: every model's)"})
    ls.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_webhooks)
