"""The operator's actions on jobs, written once for `mlxq jobs` and the dashboard: list and search
what waits, runs and was dead-lettered, read a job's record, cancel, requeue a finished job, requeue
or purge the dead-letter set.

Once API keys are registered, the actions that change anything (cancel, requeue, purge) need an admin
key (``require_admin``): that guards the operator's commands against a producer's key; the security
boundary between services stays Redis's own ACLs.
"""

from __future__ import annotations

from typing import Iterable, Iterator, Optional

from ..shared import apikeys, codec
from ..shared.codec import text as _s
from ..shared.keys import GlobalKeys
from ..shared.settings import Settings

STATUSES = ("queued", "deferred", "running", "failed")  # deferred: waiting for its run_at
SHOWN_FIELDS = ("status", "tier", "attempts", "queued_at", "started_at", "finished_at", "error", "owner")


class Admin:
    """The queues of one deployment (its prefix), read and acted on through one connection; ``api_key``
    is the operator's (an admin key once keys exist), None in open mode."""

    def __init__(self, redis, settings: Settings, api_key: Optional[str] = None):
        self.r = redis
        self.settings = settings
        self.api_key = api_key
        self.gk = GlobalKeys(settings.prefix)

    def queues(self, queue: Optional[str] = None) -> list[str]:
        """``[queue]`` when one is named; else every served model and every model with a policy copy."""
        if queue:
            return [queue]
        served = {_s(m) for m in self.r.hkeys(self.gk.models)}
        return sorted(served | {_s(m) for m in self.r.smembers(self.gk.policy_models)})

    def find(self, job_id: str, queue: Optional[str] = None) -> str:
        """The queue that holds this job; ValueError when none does."""
        queues = self.queues(queue)
        for q in queues:
            if self.r.exists(self.gk.model_keys(q).job(job_id)):
                return q
        raise ValueError(f"no job {job_id!r} in " + (", ".join(queues) or "any queue")
                         + " (finished jobs are kept for result_ttl_s)")

    def record(self, queue: str, job_id: str) -> dict:
        """The job's record by field, a finished one's tier, attempts and times included."""
        from .records import record_fields

        return record_fields(self.r.hgetall(self.gk.model_keys(queue).job(job_id)))

    def rows(self, statuses: Iterable[str], queue: Optional[str] = None, limit: int = 50) -> Iterator[dict]:
        """``{id, queue, status, tier, attempts, queued_at, error}`` of each job at ``statuses``, at most
        ``limit`` per queue and status, oldest first."""
        for q in self.queues(queue):
            k = self.gk.model_keys(q)
            sources = {"queued": k.queue, "deferred": k.deferred, "running": k.inflight, "failed": k.dead}
            for status in statuses:
                for member, _score in self.r.zrange(sources[status], 0, limit - 1, withscores=True):
                    job_id = _s(member)
                    rec = self.record(q, job_id) if len(job_id) == 32 else {}
                    why = self.r.hget(k.dead_info, member) if status == "failed" else rec.get("error")
                    yield {"id": job_id, "queue": q, "status": status, "tier": _s(rec.get("tier", b"-")),
                           "attempts": int(float(_s(rec.get("attempts", b"0")))),
                           "queued_at": float(_s(rec["queued_at"])) if rec.get("queued_at") else None,
                           "error": _s(why) if why else None}

    def search(self, statuses: Iterable[str] = STATUSES, queue: Optional[str] = None, tier: Optional[str] = None,
               key: Optional[str] = None, text: Optional[str] = None, limit: int = 50) -> list[dict]:
        """``rows`` narrowed to a tier, an API key's name (a queued or running job's, as fair shares index
        it) and ``text`` found in the id or the error; each row with ``key`` (the key's name, where known)."""
        names = apikeys.key_names(self.r, self.gk)
        out = []
        for row in self.rows(statuses, queue, limit):
            if tier and row["tier"] != tier:
                continue
            row["key"] = self._key_name(row, names)
            if key and row["key"] != key:
                continue
            if text and text not in row["id"] and text not in (row["error"] or ""):
                continue
            out.append(row)
        return out

    def _key_name(self, row: dict, names: dict[str, str]) -> Optional[str]:
        """A job's key by its fair-share group: a running job's ``g:<id>``, a queued one's member
        ``<tier>|<group>|...`` (``j:<id>``); None for a job neither names (a dead-lettered one)."""
        state = self.gk.model_keys(row["queue"]).fair_state
        member, group = self.r.hmget(state, f"j:{row['id']}", f"g:{row['id']}")
        if group is None and member is not None and _s(member).count("|") >= 3:
            group = _s(member).split("|")[1]
        return None if group is None else names.get(_s(group), "unregistered")

    def show(self, job_id: str, queue: Optional[str] = None) -> dict:
        """A job's record as an operator reads it: its fields, its request and its result's ending."""
        queue = self.find(job_id, queue)
        rec = self.record(queue, job_id)
        out = {"id": job_id, "queue": queue}
        for name in SHOWN_FIELDS:
            if name in rec:
                out[name] = _s(rec[name])
        if rec.get("req"):
            try:
                out["request"] = codec.unpack(rec["req"])
            except Exception:  # a record a producer wrote badly: say so, do not fail
                out["request"] = f"<{len(rec['req'])} bytes, not msgpack>"
        if rec.get("result"):
            try:
                res = codec.unpack(rec["result"])
            except Exception:
                res = f"<{len(rec['result'])} bytes, not msgpack>"
            out["result"] = {k: res.get(k) for k in ("finish_reason", "error", "text") if k in res} \
                if isinstance(res, dict) else res
        return out

    def require_admin(self, action: str) -> None:
        """AuthError unless keys are off (open mode) or ``api_key`` is a live admin key."""
        if not self.r.exists(self.gk.api_keys):
            return  # open mode: no keys, no roles
        if not apikeys.is_admin(self.r, self.gk, self.api_key):
            raise apikeys.AuthError(f"{action} needs an admin API key (--api-key or $MLXQ_API_KEY; "
                                    "`mlxq keys create --name NAME --tier high --admin` makes one)")

    def cancel(self, job_id: str, queue: Optional[str] = None) -> str:
        """'cancelled' (was queued), 'cancelling' (its worker stops it at the next step) or its final status."""
        from ..shared.protocol import Queue

        queue = self.find(job_id, queue)
        self.require_admin("jobs cancel")
        return Queue(self.r, self.gk.model_keys(queue), self.settings).cancel(job_id)

    def requeue(self, job_id: str, queue: Optional[str] = None) -> str:
        """The job's request again, as a new job at its tier at most (Queue.enqueue decides the tier from the
        operator's key, floored to the job's), and the old id out of the dead-letter set: the new id."""
        queue = self.find(job_id, queue)
        self.require_admin("jobs requeue")
        return self._requeue(queue, job_id)

    def _requeue(self, queue: str, job_id: str) -> str:
        from ..shared.protocol import Queue
        from ..shared.schemas import new_job_id

        rec = self.record(queue, job_id)
        status = _s(rec.get("status", b""))
        if status in ("queued", "running", "admitted", ""):
            raise ValueError(f"job {job_id} is {status or 'not a finished job'}: only a finished job is requeued")
        if not rec.get("req"):
            raise ValueError(f"job {job_id} has no request to run again")
        k = self.gk.model_keys(queue)
        key_hash = apikeys.key_hash(self.api_key) if self.api_key else None
        floor = _s(rec["tier"]) if rec.get("tier") else None
        got = Queue(self.r, k, self.settings).enqueue(new_job_id(), rec["req"], key_hash, floor, global_redis=self.r)
        self.r.zrem(k.dead, job_id)
        self.r.hdel(k.dead_info, job_id)
        return got.job_id

    def purge_failed(self, queue: Optional[str] = None) -> dict[str, int]:
        """Empty the dead-letter set of ``queue`` (default: every queue): how many went, by queue."""
        self.require_admin("jobs failed purge")
        gone = {}
        for q in self.queues(queue):
            k = self.gk.model_keys(q)
            gone[q] = self.r.zcard(k.dead)
            self.r.delete(k.dead, k.dead_info)
        return gone

    def requeue_failed(self, ids: Optional[Iterable[str]] = None, every: bool = False,
                       queue: Optional[str] = None) -> list[tuple[str, Optional[str]]]:
        """Requeue the dead-lettered ``ids`` (or ``every`` one): ``(old id, new id)`` pairs, the new id None
        for a member that is no job (garbage a producer pushed, left for purge)."""
        self.require_admin("jobs failed requeue")
        ids = set(ids or ())
        if not ids and not every:
            raise ValueError("name the jobs to requeue, or --all")
        targets = []
        for q in self.queues(queue):
            members = [_s(m) for m in self.r.zrange(self.gk.model_keys(q).dead, 0, -1)]
            targets += [(q, m) for m in members if every or m in ids]
        missing = ids - {m for _, m in targets}
        if missing:
            raise ValueError(f"not in the dead-letter set: {', '.join(sorted(missing))}")
        return [(job_id, self._requeue(q, job_id) if len(job_id) == 32 else None) for q, job_id in targets]
