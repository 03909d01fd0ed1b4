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
from typing import Iterator, Optional

from ..shared.settings import Settings
from .options import add_shared

STATUSES = ("queued", "deferred", "running", "failed")  # deferred: waiting for its run_at
SHOWN_FIELDS = ("status", "tier", "attempts", "queued_at", "started_at", "finished_at", "error", "owner")


def _s(x) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


class Jobs:
    """The queues of one deployment (its prefix), read through one connection."""

    def __init__(self, args):
        from ..producer.client import connect
        from ..shared.keys import GlobalKeys

        self.args = args
        self.settings = Settings.from_env(redis_url=args.redis_url)
        self.r = connect(args.redis_url, self.settings.redis_outage_s)
        self.gk = GlobalKeys(self.settings.prefix)

    def queues(self) -> list[str]:
        if getattr(self.args, "queue", None):
            return [self.args.queue]
        served = {_s(m) for m in self.r.hkeys(self.gk.models)}
        return sorted(served | {_s(m) for m in self.r.smembers(self.gk.policy_models)})

    def find(self, job_id: str) -> str:
        """The queue that holds this job; ValueError when none does."""
        for queue in self.queues():
            if self.r.exists(self.gk.model_keys(queue).job(job_id)):
                return queue
        raise ValueError(f"no job {job_id!r} in " + (", ".join(self.queues()) or "any queue")
                         + " (finished jobs are kept for result_ttl_s)")

    def record(self, queue: str, job_id: str) -> dict:
        """The job's record by field, a finished one's tier, attempts and times included."""
        from ..producer.records import record_fields

        return record_fields(self.r.hgetall(self.gk.model_keys(queue).job(job_id)))

    def rows(self, statuses) -> Iterator[dict]:
        limit = self.args.limit
        for queue in self.queues():
            k = self.gk.model_keys(queue)
            sources = {"queued": k.queue, "deferred": k.deferred, "running": k.inflight, "failed": k.dead}
            for status in statuses:
                for member, _score in self.r.zrange(sources[status], 0, limit - 1, withscores=True):
                    job_id = _s(member)
                    rec = self.record(queue, job_id) if len(job_id) == 32 else {}
                    why = self.r.hget(k.dead_info, member) if status == "failed" else rec.get("error")
                    yield {"id": job_id, "queue": queue, "status": status, "tier": _s(rec.get("tier", b"-")),
                           "attempts": int(float(_s(rec.get("attempts", b"0")))),
                           "queued_at": float(_s(rec["queued_at"])) if rec.get("queued_at") else None,
                           "error": _s(why) if why else None}

    def require_admin(self, action: str) -> None:
        from ..shared import apikeys

        if not self.r.exists(self.gk.api_keys):
            return  # open mode: no keys, no roles
        if not apikeys.is_admin(self.r, self.gk, self.args.api_key):
            raise apikeys.AuthError(f"{action} needs an admin API key (--api-key or $MLXQ_API_KEY; "
                                    "`mlxq keys create --name NAME --tier high --admin` makes one)")

    def client(self, queue: str):
        from ..producer.client import Client

        return Client(self.args.redis_url, api_key=self.args.api_key, model=queue, settings=self.settings)

    def requeue(self, queue: str, job_id: str) -> str:
        """The job's request again, as a new job at its tier at most (Queue.enqueue decides the tier from the
        operator's key, floored to the job's), and the old id out of the dead-letter set."""
        from ..shared.protocol import Queue
        from ..shared.schemas import new_job_id

        rec = self.record(queue, job_id)
        status = _s(rec.get("status", b""))
        if status in ("queued", "running", "admitted", ""):
            raise ValueError(f"job {job_id} is {status or 'not a finished job'}: only a finished job is requeued")
        if not rec.get("req"):
            raise ValueError(f"job {job_id} has no request to run again")
        from ..shared import apikeys

        k = self.gk.model_keys(queue)
        key_hash = apikeys.key_hash(self.args.api_key) if self.args.api_key else None
        floor = _s(rec["tier"]) if rec.get("tier") else None
        new_id = new_job_id()
        got = Queue(self.r, k, self.settings).enqueue(new_id, rec["req"], key_hash, floor, global_redis=self.r)
        self.r.zrem(k.dead, job_id)
        self.r.hdel(k.dead_info, job_id)
        return got.job_id


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
    rows = list(j.rows(j.args.status or STATUSES))
    _print_rows(rows, j.args.json, "no jobs waiting, running or dead-lettered")
    return 0


def cmd_show(j: Jobs) -> int:
    from ..shared import codec

    queue = j.find(j.args.id)
    rec = j.record(queue, j.args.id)
    out = {"id": j.args.id, "queue": queue}
    for name in SHOWN_FIELDS:
        if name in rec:
            out[name] = _s(rec[name])
    if rec.get("req"):
        try:
            out["request"] = codec.unpack(rec["req"])
        except Exception:  # a record a producer wrote badly: say so, do not fail
            out["request"] = f"<{len(rec['req'])} bytes, not msgpack>"
    if rec.get("result"):
        res = codec.unpack(rec["result"])
        out["result"] = {k: res.get(k) for k in ("finish_reason", "error", "text") if k in res} \
            if isinstance(res, dict) else res
    print(json.dumps(out, indent=2, default=repr, ensure_ascii=False))
    return 0


def cmd_cancel(j: Jobs) -> int:
    queue = j.find(j.args.id)
    j.require_admin("jobs cancel")
    with j.client(queue) as c:
        print(c.job(j.args.id, queue).cancel())
    return 0


def cmd_tail(j: Jobs) -> int:
    queue = j.find(j.args.id)
    with j.client(queue) as c:
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
    queue = j.find(j.args.id)
    j.require_admin("jobs requeue")
    print(j.requeue(queue, j.args.id))
    return 0


def cmd_failed(j: Jobs) -> int:
    action = j.args.failed_action or "list"
    if action == "list":
        _print_rows(list(j.rows(("failed",))), j.args.json, "the dead-letter set is empty")
        return 0
    j.require_admin(f"jobs failed {action}")
    if action == "purge":
        for queue in j.queues():
            k = j.gk.model_keys(queue)
            n = j.r.zcard(k.dead)
            j.r.delete(k.dead, k.dead_info)
            print(f"{queue}: {n} purged")
        return 0
    if not j.args.ids and not j.args.all:
        raise ValueError("name the jobs to requeue, or --all")
    targets = []
    for queue in j.queues():
        members = [_s(m) for m in j.r.zrange(j.gk.model_keys(queue).dead, 0, -1)]
        targets += [(queue, m) for m in members if j.args.all or m in j.args.ids]
    missing = set(j.args.ids or ()) - {m for _, m in targets}
    if missing:
        raise ValueError(f"not in the dead-letter set: {', '.join(sorted(missing))}")
    for queue, job_id in targets:
        if len(job_id) != 32:  # garbage a producer pushed: nothing to run
            print(f"{job_id[:40]!r}: not a job, left for purge", file=sys.stderr)
            continue
        print(f"{job_id} -> {j.requeue(queue, job_id)}")
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
