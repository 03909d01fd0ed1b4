"""The Redis protocol of one model's queue: every atomic change is one Lua script.

``ScriptCalls`` turns a request into (script, keys, args) with no I/O, so the
sync ``Queue`` (workers, ``Client``) and ``AsyncClient`` share one definition.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from importlib import resources
from typing import Any, Optional

from .connection import for_slot, is_cluster
from .keys import ModelKeys
from .settings import Settings

SCRIPT_NAMES = ("enqueue", "pull", "complete", "requeue", "cancel", "renew", "reap")


@functools.cache
def script_source(name: str) -> str:
    return resources.files(__package__).joinpath("lua", f"{name}.lua").read_text()


class OverloadError(RuntimeError):
    """The tier's queue is full (HTTP 429): retry later."""


class JobRefused(ValueError):
    """A job the system will not take (unknown key, too large, invalid)."""


@dataclass
class Enqueued:
    status: str  # ok | duplicate
    job_id: str
    score: Optional[float]
    queued_at: Optional[float]


@dataclass
class Pulled:
    """One entry taken from the queue by ``pull``."""

    job_id: str
    kind: str  # "job" (leased to us) or "garbage" (moved to the dead-letter set)
    raw_request: bytes
    attempt: int
    tier: str
    score: float
    queued_at: float
    resume: bytes
    now: float


def _s(x: Any) -> str:
    # 'replace': a forged non-UTF-8 queue member must not break a pull (job ids are hex)
    return x.decode(errors="replace") if isinstance(x, bytes) else ("" if x is None else str(x))


def _f(x: Any) -> float:
    s = _s(x)
    return float(s) if s else 0.0


def parse_enqueue(reply: list) -> Enqueued:
    status, job_id, score, now = (_s(x) for x in reply)
    if status == "overload":
        raise OverloadError(f"queue full: {score} jobs already waiting at this tier")
    if status == "exists":
        raise JobRefused(f"job id {job_id} already exists")
    return Enqueued(status, job_id, float(score) if score else None, float(now) if now else None)


def parse_pull(reply: list) -> list[Pulled]:
    out = []
    for row in reply:
        job_id, kind, req, attempt, tier, score, queued_at, resume, now = row
        out.append(
            Pulled(
                job_id=_s(job_id),
                kind=_s(kind),
                raw_request=req if isinstance(req, bytes) else _s(req).encode(),
                attempt=int(_s(attempt) or 0),
                tier=_s(tier),
                score=_f(score),
                queued_at=_f(queued_at),
                resume=resume if isinstance(resume, bytes) else _s(resume).encode(),
                now=_f(now),
            )
        )
    return out


class ScriptCalls:
    """Keys and arguments for each script; no I/O."""

    def __init__(self, keys: ModelKeys, settings: Settings, cluster: bool = False):
        self.k = keys
        self.s = settings
        # Token deltas and wake-ups go out on the model's slot on a cluster (sharded pub/sub);
        # classic PUBLISH on a cluster is broadcast to every node.
        self.pubcmd = "SPUBLISH" if cluster else "PUBLISH"

    def enqueue(self, job_id: str, request: bytes, tier: str, idempotency_key: str | None):
        k, s = self.k, self.s
        idem = k.idempotency(idempotency_key) if idempotency_key else k.job(job_id)
        return (
            "enqueue",
            [k.queue, k.job(job_id), k.counts, k.wake, idem],
            [job_id, request, tier, s.tier_offsets[tier], s.max_queued_per_tier,
             "1" if idempotency_key else "0", s.idempotency_ttl_s],
        )

    def pull(self, n: int, worker_id: str):
        k = self.k
        return ("pull", [k.queue, k.inflight, k.counts, k.dead, k.dead_info],
                [n, self.s.lease_s, worker_id, k.job_prefix, k.events(""), k.channel(""), self.s.result_ttl_s,
                 k.done(""), self.pubcmd])

    def complete(self, job_id: str, owner: str, status: str, result: bytes, final_delta: bytes):
        k = self.k
        return (
            "complete",
            [k.job(job_id), k.inflight, k.counts, k.events(job_id), k.done(job_id), k.channel(job_id)],
            [job_id, owner, status, result, self.s.result_ttl_s, final_delta, self.pubcmd],
        )

    def requeue(self, job_id: str, owner: str, resume: bytes = b""):
        k = self.k
        return ("requeue", [k.job(job_id), k.inflight, k.queue, k.counts, k.wake], [job_id, owner, resume])

    def cancel(self, job_id: str):
        k = self.k
        return (
            "cancel",
            [k.queue, k.job(job_id), k.counts, k.events(job_id), k.done(job_id), k.cancel_channel,
             k.channel(job_id)],
            [job_id, self.pubcmd, "", self.s.result_ttl_s],
        )

    def renew(self, leases: dict[str, str]):
        args: list = [self.s.lease_s, ""]
        keys = [self.k.inflight]
        for job_id, owner in leases.items():
            args += [job_id, owner]
            keys.append(self.k.job(job_id))
        return ("renew", keys, args)

    def reap(self, limit: int = 100):
        k = self.k
        events_prefix = k.events("")
        chan_prefix = k.channel("")
        return (
            "reap",
            [k.inflight, k.queue, k.counts, k.dead, k.dead_info, k.wake],
            [self.s.max_attempts, k.job_prefix, events_prefix, chan_prefix, self.s.result_ttl_s, limit,
             k.done(""), self.pubcmd],
        )


def owner_token(worker_id: str, attempt: int) -> str:
    return f"{worker_id}:{attempt}"


class Queue:
    """Synchronous access to one model's queue (workers and the sync client)."""

    def __init__(self, redis, keys: ModelKeys, settings: Settings):
        redis = for_slot(redis, keys.queue)  # on a cluster: a plain client on the slot's master
        self.redis = redis
        self.keys = keys
        self.settings = settings
        self.cluster = is_cluster(redis)
        self.calls = ScriptCalls(keys, settings, self.cluster)
        self._scripts = {name: redis.register_script(script_source(name)) for name in SCRIPT_NAMES}

    def run(self, call, client=None):
        name, keys, args = call
        return self._scripts[name](keys=keys, args=args, client=client or self.redis)

    def enqueue(self, job_id, request: bytes, tier: str, idempotency_key=None) -> Enqueued:
        return parse_enqueue(self.run(self.calls.enqueue(job_id, request, tier, idempotency_key)))

    def pull(self, n: int, worker_id: str) -> list[Pulled]:
        return parse_pull(self.run(self.calls.pull(n, worker_id)))

    def complete(self, job_id, owner, status, result: bytes, final_delta: bytes = b"", client=None):
        return self.run(self.calls.complete(job_id, owner, status, result, final_delta), client)

    def requeue(self, job_id, owner, resume: bytes = b"", client=None):
        return self.run(self.calls.requeue(job_id, owner, resume), client)

    def cancel(self, job_id: str) -> str:
        return _s(self.run(self.calls.cancel(job_id)))

    def renew(self, leases: dict[str, str]) -> tuple[list[str], list[str]]:
        if not leases:
            return [], []
        lost, cancel = self.run(self.calls.renew(leases))
        return [_s(x) for x in lost], [_s(x) for x in cancel]

    def reap(self, limit: int = 100) -> tuple[int, int, int]:
        requeued, dead, cancelled = self.run(self.calls.reap(limit))
        return int(requeued), int(dead), int(cancelled)

    def counts(self) -> dict[str, int]:
        return {_s(k): int(v) for k, v in self.redis.hgetall(self.keys.counts).items()}
