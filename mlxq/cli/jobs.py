"""``mlxq jobs``: the operator's view of single jobs, after rq's ``rq info`` and ``rq requeue``.

    mlxq jobs list [--queue Q] [--status queued|deferred|running|failed]   what waits, runs, and was dead-lettered
    mlxq jobs show ID            a job's record (status, tier, attempts, times, error, request, result)
    mlxq jobs cancel ID          cancel it (Job.cancel: queued, it ends now; running, its worker stops it)
    mlxq jobs tail ID            its tokens as they come (a finished job: replayed from its record)
    mlxq jobs requeue ID         run a failed, dead-lettered or cancelled job's request again, as a new job
    mlxq jobs failed [list]      the dead-letter set (jobs that used every attempt) with why
    mlxq jobs failed requeue (ID... | --all)   requeue from it;   mlxq jobs failed purge   empty it

Once API keys are registered, cancel, requeue and purge need an admin key (``--api-key`` or
``$MLXQ_API_KEY``; ``mlxq keys create --admin``). That guards the operator's commands against a
producer's key; the security boundary between services stays Redis's own ACLs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Optional

from ..producer.admin import STATUSES
from ..shared.settings import Settings
from .options import add_shared


class Jobs:
    """The CLI's arguments and the library's operator actions (producer/admin.py) on one connection."""

    def __init__(self, args):
        from ..producer.admin import Admin
        from ..producer.client import connect

        self.args = args
        settings = Settings.from_env(redis_url=args.redis_url)
        self.admin = Admin(connect(args.redis_url, settings.redis_outage_s), settings,
                           getattr(args, "api_key", None))

    @property
    def queue(self):
        return getattr(self.args, "queue", None)


def _age(t: Optional[float]) -> str:
    if t is None:
        return "-"
    s = max(0.0, time.time() - t)
    return f"{s:.0f}s" if s < 120 else f"{s / 60:.0f}m" if s < 7200 else f"{s / 3600:.0f}h"


def _print_rows(rows: list[dict], as_json: bool, empty: str) -> None:
    if as_json:
        print(json.dumps(rows, indent=2))
        return
    if not rows:
        print(empty)
        return
    print(f"{'ID':32}  {'QUEUE':16} {'STATUS':8} {'TIER':6} {'TRIES':>5} {'AGE':>5}  ERROR")
    for r in rows:
        print(f"{r['id'][:32]:32}  {r['queue'][:16]:16} {r['status']:8} {r['tier']:6} {r['attempts']:>5} "
              f"{_age(r['queued_at']):>5}  {(r['error'] or '')[:80]}")


def cmd_list(j: Jobs) -> int:
    rows = list(j.admin.rows(j.args.status or STATUSES, j.queue, j.args.limit))
    _print_rows(rows, j.args.json, "no jobs waiting, running or dead-lettered")
    return 0


def cmd_show(j: Jobs) -> int:
    print(json.dumps(j.admin.show(j.args.id, j.queue), indent=2, default=repr, ensure_ascii=False))
    return 0


def cmd_cancel(j: Jobs) -> int:
    print(j.admin.cancel(j.args.id, j.queue))
    return 0


def cmd_tail(j: Jobs) -> int:
    from ..producer.client import Client

    queue = j.admin.find(j.args.id, j.queue)
    with Client(j.args.redis_url, api_key=j.args.api_key, model=queue, settings=j.admin.settings) as c:
        job = c.job(j.args.id, queue)
        for delta in job.stream():
            sys.stdout.write(delta.text)
            sys.stdout.flush()
        result = job.result(timeout=10)
    sys.stdout.write("\n")
    if result.error:
        print(f"error: {result.error}", file=sys.stderr)
    print(f"[{result.finish_reason}]", file=sys.stderr)
    return 0 if result.finish_reason != "error" else 1


def cmd_requeue(j: Jobs) -> int:
    print(j.admin.requeue(j.args.id, j.queue))
    return 0


def cmd_failed(j: Jobs) -> int:
    action = j.args.failed_action or "list"
    if action == "list":
        _print_rows(list(j.admin.rows(("failed",), j.queue, j.args.limit)), j.args.json,
                    "the dead-letter set is empty")
        return 0
    if action == "purge":
        for queue, n in j.admin.purge_failed(j.queue).items():
            print(f"{queue}: {n} purged")
        return 0
    for old, new in j.admin.requeue_failed(j.args.ids, j.args.all, j.queue):
        if new is None:
            print(f"{old[:40]!r}: not a job, left for purge", file=sys.stderr)
        else:
            print(f"{old} -> {new}")
    return 0


COMMANDS = {"list": cmd_list, "show": cmd_show, "cancel": cmd_cancel, "tail": cmd_tail, "requeue": cmd_requeue,
            "failed": cmd_failed}


def cmd_jobs(args) -> int:
    return COMMANDS[args.action](Jobs(args))


def _listing(p: argparse.ArgumentParser) -> None:
    p.add_argument("--limit", type=int, default=50, help="at most this many per queue and status")
    p.add_argument("--json", action="store_true", help="print JSON")


def add_commands(sub) -> None:
    p = sub.add_parser("jobs", help="list, show, cancel, tail and requeue jobs; the dead-letter set")
    add_shared(p, "redis_url")
    js = p.add_subparsers(dest="action", required=True)

    a = js.add_parser("list", help="jobs waiting, running and dead-lettered")
    add_shared(a, "redis_url", "queue", help={"queue": "only this queue (default: every queue)"})
    a.add_argument("--status", action="append", choices=STATUSES, help="only these (repeat) (default: all)")
    _listing(a)
    for name, text in (("show", "a job's record"), ("cancel", "cancel a job (admin once keys exist)"),
                       ("tail", "stream a job's tokens (a finished job's are replayed)"),
                       ("requeue", "run a finished job's request again as a new job (admin once keys exist)")):
        a = js.add_parser(name, help=text)
        add_shared(a, "redis_url", "queue", "api_key", help={"queue": "the job's queue (default: looked up)"})
        a.add_argument("id", help="the job id")

    f = js.add_parser("failed", help="the dead-letter set: list, requeue, purge")
    add_shared(f, "redis_url", "queue", "api_key", help={"queue": "only this queue (default: every queue)"})
    fs = f.add_subparsers(dest="failed_action")
    fl = fs.add_parser("list", help="the dead-lettered jobs and why (the default)")
    add_shared(fl, "redis_url", "queue", "api_key")
    _listing(fl)
    fr = fs.add_parser("requeue", help="run dead-lettered jobs again (admin once keys exist)")
    add_shared(fr, "redis_url", "queue", "api_key")
    fr.add_argument("ids", nargs="*", help="job ids (default: none; --all for every one)")
    fr.add_argument("--all", action="store_true", help="every dead-lettered job")
    fp = fs.add_parser("purge", help="empty the dead-letter set (admin once keys exist)")
    add_shared(fp, "redis_url", "queue", "api_key")
    f.set_defaults(limit=50, json=False)
    p.set_defaults(func=cmd_jobs)
