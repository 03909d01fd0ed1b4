"""``mlxq stats``: each model's queue and workers, once or every N seconds (``--watch``)."""

from __future__ import annotations

import argparse
import json
import sys
import time

from ..shared.settings import Settings
from .options import add_shared


def cmd_stats(args) -> int:
    from ..producer import stats
    from ..producer.client import connect

    settings = Settings.from_env()
    r = connect(args.redis_url, settings.redis_outage_s)
    prefix = settings.prefix
    shown = 0
    while True:
        data = stats.collect(r, prefix)
        text = json.dumps(data, indent=2, default=str) if args.json else stats.render(data)
        if args.watch and sys.stdout.isatty() and not args.json:
            sys.stdout.write("\x1b[H\x1b[2J")  # redraw in place, as watch(1) does
        if args.watch:
            text = f"{time.strftime('%H:%M:%S')}  every {args.watch:g}s (Ctrl-C to stop)\n{text}"
        print(text, flush=True)
        shown += 1
        if not args.watch or (args.count and shown >= args.count):
            return 0
        try:
            time.sleep(args.watch)
        except KeyboardInterrupt:
            return 0


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be above 0 seconds, got {text}")
    return value


def add_commands(sub) -> None:
    p = sub.add_parser("stats", help="queue and worker stats")
    add_shared(p, "redis_url")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.add_argument("--watch", type=_positive, metavar="SECONDS",
                   help="print them again every SECONDS until Ctrl-C (default: once)")
    p.add_argument("--count", type=int, help=argparse.SUPPRESS)  # --watch: stop after this many (tests)
    p.set_defaults(func=cmd_stats)
