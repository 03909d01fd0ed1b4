"""The Redis protocol of one model's queue: every atomic change is one Lua script.

``ScriptCalls`` turns a request into (script, keys, args) with no I/O, and ``enqueue_steps`` /
``cancel_steps`` decide which scripts an enqueue or a cancel runs (EVALSHA or mlxq's Functions, a key
registry to copy first), so the sync ``Queue`` (workers, ``Client``) and ``AsyncClient`` share one
definition and differ only in how they send.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from importlib import resources
from typing import Any, NamedTuple, Optional

from redis.exceptions import NoPermissionError, ResponseError

from . import codec
from .connection import replica_acked
from .apikeys import AuthError
from .keys import ModelKeys
from .settings import Settings
from .slots import for_slot, is_cluster, one_connection
from .steps import run_steps

SCRIPT_NAMES = ("enqueue", "admit", "pick", "pull", "deltas", "complete", "requeue", "cancel", "renew", "reap",
                "check", "submit", "cancel_request", "promote", "expire")
# shared helpers put ahead of a script's body: _id checks a job id, _tier decides a tier, _end ends a
# job's record, _sched reads and writes an admitted job's worker-only facts, _compact folds a finished
# job's event stream into its record, _fair indexes a job for fair shares between API keys, _life checks
# and records run_at, expires_at and webhook, _wake rings a model's wake-up list for its workers
_PRELUDE_NAMES = ("_id", "_tier", "_end", "_sched", "_compact", "_fair", "_life", "_wake")
_PRELUDES = {"complete": ("_compact", "_fair"), "enqueue": ("_id", "_tier", "_end", "_fair", "_life", "_wake"),
             "submit": ("_id", "_end", "_life"),
             "admit": ("_id", "_tier", "_end", "_sched", "_fair", "_life", "_wake"),
             "pick": ("_fair",), "check": ("_tier", "_fair"), "pull": ("_id", "_end", "_sched", "_fair", "_life"),
             "reap": ("_end", "_sched", "_fair", "_wake"), "requeue": ("_end", "_sched", "_fair", "_wake"),
             "cancel": ("_end", "_sched"), "cancel_request": ("_end",), "promote": ("_sched", "_fair", "_wake"),
             "expire": ("_end", "_sched", "_fair", "_life")}
_READ_ONLY = ("check",)  # registered with the no-writes flag: callable with FCALL_RO
FUNCTION_LIBRARY = "mlxq"


def _lua(name: str) -> str:
    return resources.files(__package__).joinpath("lua", f"{name}.lua").read_text()


@functools.cache
def script_source(name: str) -> str:
    return "\n".join([*(_lua(p) for p in _PRELUDES.get(name, ())), _lua(name)])


def function_name(name: str) -> str:
    return f"{FUNCTION_LIBRARY}_{name}"


@functools.cache
def function_library() -> str:
    """Every script as a Redis Function of one library (``FUNCTION LOAD``), so that an ACL can
    allow ``FCALL`` while refusing ``EVAL``/``EVALSHA`` (no new code can be run)."""
    parts = [f"#!lua name={FUNCTION_LIBRARY}",
             *(_lua(p) for p in _PRELUDE_NAMES)]
    for name in SCRIPT_NAMES:
        flags = ", flags = {'no-writes'}" if name in _READ_ONLY else ""
        parts.append(f"redis.register_function{{function_name = '{function_name(name)}', "
                     f"callback = function(KEYS, ARGV)\n{_lua(name)}\nend{flags}}}")
    return "\n".join(parts)


def load_functions(redis) -> None:
    """Load (or replace) the library on every master: a worker does it at start."""
    from .slots import SlotRedis

    code = function_library()
    cluster = redis.cluster if isinstance(redis, SlotRedis) else redis
    if is_cluster(cluster):
        for node in cluster.get_primaries():
            cluster.get_redis_connection(node).function_load(code, replace=True)
    else:
        cluster.function_load(code, replace=True)


class FunctionsNotLoaded(RuntimeError):
    """This Redis user may only FCALL mlxq's functions, and they are not loaded yet."""


def fcall_failed(exc: ResponseError) -> None:
    """A failed FCALL: ``FunctionsNotLoaded`` when mlxq's library is not loaded (no worker has started
    on this Redis yet); else it returns and the caller re-raises (the sync and async clients alike)."""
    if "function not found" in str(exc).lower():
        raise FunctionsNotLoaded("mlxq's Redis Functions are not loaded: start a worker (it loads them) "
                                 "first") from exc


class PolicyNotCopied(RuntimeError):
    """The model's slot has no copy of the key registry and tier policy yet (no worker has run)."""


class OverloadError(RuntimeError):
    """The tier's queue is full (HTTP 429): retry later."""


class QuotaExceeded(RuntimeError):
    """The API key's daily token quota on this model is used up (HTTP 429): ``retry_after_s``, the seconds
    until the next UTC day, when it is counted afresh."""

    def __init__(self, retry_after_s: float):
        self.retry_after_s = float(retry_after_s)
        super().__init__(f"the API key's daily token quota is used up: retry in {self.retry_after_s:.0f} s, "
                         "at the next UTC day")


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
    # The error a failed worker gave this job back with ("" if none): it was held by an engine that
    # raised, so the worker runs it alone (a job that fails alone fails for itself, not its batch-mates).
    suspect: str = ""


def _s(x: Any) -> str:
    # 'replace': a forged non-UTF-8 queue member must not break a pull (job ids are hex)
    return x.decode(errors="replace") if isinstance(x, bytes) else ("" if x is None else str(x))


def _f(x: Any) -> float:
    s = _s(x)
    return float(s) if s else 0.0


def parse_enqueue(reply: list) -> Enqueued:
    status, job_id, score, now = (_s(x) for x in reply)
    if status == "unauthorized":
        raise AuthError(score)
    if status == "unsynced":
        raise PolicyNotCopied(job_id)
    if status == "overload":
        raise OverloadError(f"queue full: {score} jobs already waiting at this tier")
    if status == "quota":
        raise QuotaExceeded(float(score))
    if status == "exists":
        raise JobRefused(f"job id {job_id} already exists")
    if status == "invalid_id":
        raise JobRefused(f"job id {job_id!r} is not 32 lowercase hex digits")
    if status == "invalid_time":
        raise JobRefused(score)  # expires_at past, or not after run_at: the script says which
    if status == "invalid_idempotency_key":
        raise JobRefused("the idempotency key's name is not scoped to the caller's API key "
                         "(B:idem:<sha1hex('idem:' + sha256hex(api key))>:<key>)")
    return Enqueued(status, job_id, float(score) if score else None, float(now) if now else None)


def parse_check(reply: list) -> str:
    """The tier a restricted producer's job would get now, or the refusal raised."""
    status, detail = (_s(x) for x in reply)
    if status == "unauthorized":
        raise AuthError(detail)
    if status == "overload":
        raise OverloadError(f"queue full: {detail} jobs already waiting at this tier")
    if status == "unsynced":
        raise PolicyNotCopied("")
    if status == "quota":
        raise QuotaExceeded(float(detail))
    return detail


def parse_pull(reply: list) -> list[Pulled]:
    out = []
    for row in reply:
        job_id, kind, req, attempt, tier, score, queued_at, resume, now, suspect = row
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
                suspect=_s(suspect),
            )
        )
    return out


def run_script(r, scripts: dict, call, functions: bool, read_only: bool = False):
    """Send one script call on ``r`` as EVALSHA (``scripts``: the registered scripts) or, with
    ``functions``, as FCALL (FCALL_RO when ``read_only``): the reply, or the awaitable of it when ``r``
    is an asyncio client (its caller awaits, and gives a failed FCALL to ``fcall_failed``)."""
    name, keys, args = call
    if functions:
        fcall = r.fcall_ro if read_only else r.fcall
        return fcall(function_name(name), len(keys), *keys, *args)
    return scripts[name](keys=keys, args=args, client=r)


# -- enqueue and cancel, decided once: ``Queue`` does their I/O, ``AsyncClient`` awaits it ------------

@dataclass(frozen=True)
class RunScript:
    """Run ``call`` (``run_script``; reply: the script's reply).  ``acked``: the job id of a submit,
    after which, with ``submit_replica_ack_ms`` set, ``WAIT 1 <ms>`` on the same connection."""
    call: tuple
    read_only: bool = False
    acked: Optional[str] = None


@dataclass(frozen=True)
class CopyPolicy:
    """The model's slot has no copy of the key registry yet: a trusted caller copies it there
    (``apikeys.sync_model``); one that may not raises ``not_copied(model)``.  Reply ignored."""
    model: str


def not_copied(model: str) -> PolicyNotCopied:
    return PolicyNotCopied(f"model {model!r} has no copy of the key registry yet: start its worker first")


def copy_policy(global_redis, slot_redis, keys: ModelKeys) -> None:
    """``CopyPolicy``'s I/O (sync: the async client runs it on a thread): copy the key registry from
    ``global_redis`` into the model's slot on ``slot_redis``; ``not_copied`` for a caller that may not
    (no client reaching the global keys, or an ACL that refuses it)."""
    from .apikeys import sync_model
    from .keys import GlobalKeys

    if global_redis is None:
        raise not_copied(keys.model)
    try:
        sync_model(global_redis, slot_redis, GlobalKeys(keys.prefix), keys.model)
    except NoPermissionError:
        raise not_copied(keys.model) from None


def enqueue_steps(user, calls: "ScriptCalls", job_id: str, request: bytes, key_hash: str | None,
                  floor: str | None, idempotency_key: str | None):
    """Enqueue a job (returns ``Enqueued``): the tier is decided in Redis from ``key_hash`` (sha256 of
    the API key) and ``floor``.  A caller whose ACL refuses EVALSHA (a producer under the recipe in
    ``mlxq.shared.acl``) switches to mlxq's Functions for good (``user.functions`` set): ``check``
    (read-only), then ``submit`` to the intake list, from which a worker admits the job."""
    def attempt():
        if not user.functions:
            try:
                return parse_enqueue((yield RunScript(calls.enqueue(job_id, request, key_hash, floor, idempotency_key),
                                                      acked=job_id)))
            except NoPermissionError:  # EVALSHA refused before anything ran
                user.functions = True
        parse_check((yield RunScript(calls.check(key_hash, floor), read_only=True)))
        return parse_enqueue((yield RunScript(calls.submit(job_id, request, key_hash, floor, idempotency_key),
                                              acked=job_id)))

    try:
        return (yield from attempt())
    except PolicyNotCopied:
        pass
    yield CopyPolicy(calls.k.model)  # no worker has served this model yet
    return (yield from attempt())


def cancel_steps(user, calls: "ScriptCalls", job_id: str, mode: str = "queue"):
    """Cancel a job (returns its status after, as text); a caller that may not run the scripts sends
    a cancel request, for the job's worker to act on."""
    if not user.functions:
        try:
            return _s((yield RunScript(calls.cancel(job_id, mode))))
        except NoPermissionError:
            user.functions = True
    return _s((yield RunScript(calls.cancel_request(job_id))))


class ScriptCalls:
    """Keys and arguments for each script; no I/O."""

    def __init__(self, keys: ModelKeys, settings: Settings, cluster: bool = False):
        self.k = keys
        self.s = settings
        # Token deltas and wake-ups go out on the model's slot on a cluster (sharded pub/sub);
        # classic PUBLISH on a cluster is broadcast to every node.
        self.pubcmd = "SPUBLISH" if cluster else "PUBLISH"

    def enqueue(self, job_id: str, request: bytes, key_hash: str | None, floor: str | None,
                idempotency_key: str | None):
        """``key_hash``: sha256 of the caller's API key (None: anonymous); the tier is decided in Redis."""
        k, s = self.k, self.s
        idem = k.idempotency(idempotency_key, key_hash) if idempotency_key else k.job(job_id)
        return (
            "enqueue",
            [k.job(job_id), k.counts, k.wake, idem, k.intake, k.queue, k.key_copy, k.policy, k.deferred, k.expiring,
             k.webhooks, *k.fair_keys],
            [job_id, request, key_hash or "", floor or "", "1" if idempotency_key else "0", s.idempotency_ttl_s,
             *life_args(request)],
        )

    # -- producers under the ACL recipe (mlxq.shared.acl): no write to the queue ------------------
    def check(self, key_hash: str | None, floor: str | None):
        k = self.k
        return ("check", [k.key_copy, k.policy, k.counts, k.usage], [key_hash or "", floor or ""])

    def submit(self, job_id: str, request: bytes, key_hash: str | None, floor: str | None,
               idempotency_key: str | None):
        """submit.lua (the Function ``mlxq_submit``: script names are the protocol's): the job's record and
        its id on the intake list, where a worker's ``admit`` decides tier and score."""
        k, s = self.k, self.s
        idem = k.idempotency(idempotency_key, key_hash) if idempotency_key else k.job(job_id)
        return ("submit", [k.job(job_id), idem, k.intake, k.wake],
                [job_id, request, key_hash or "", floor or "", "1" if idempotency_key else "0",
                 s.idempotency_ttl_s, *life_args(request)])

    def cancel_request(self, job_id: str):
        k = self.k
        return ("cancel_request", [k.job(job_id), k.events(job_id), k.done(job_id)],
                [job_id, self.pubcmd, k.cancel_channel, k.channel(job_id), self.s.result_ttl_s])

    def _per_member(self, members: list) -> list:
        """The four keys of each member (job, events, done list, channel), declared to the script.
        Members are raw bytes (a forged member need not be UTF-8); keys share the queue's slot."""
        k = self.k
        out: list = []
        for m in members:
            raw = m if isinstance(m, bytes) else str(m).encode()
            out += [k.job_prefix.encode() + raw, k.events("").encode() + raw, k.done("").encode() + raw,
                    k.channel("").encode() + raw]
        return out

    def admit(self, ids: list):
        """Admit ``ids``, the head of the intake list as the caller read it (LRANGE)."""
        k = self.k
        return ("admit", [k.intake, k.queue, k.counts, k.key_copy, k.policy, k.wake, k.sched, k.deferred, k.expiring,
                          k.webhooks, *k.fair_keys, *self._per_member(ids)],
                [self.s.result_ttl_s, self.pubcmd, *ids])

    def promote(self, ids: list):
        """Queue the deferred jobs among ``ids`` (the head of the deferred set) whose run_at has come; each
        joins fair shares as it is queued."""
        k = self.k
        return ("promote", [k.deferred, k.queue, k.counts, k.sched, k.wake, *k.fair_keys,
                            *(k.job_prefix.encode() + (i if isinstance(i, bytes) else str(i).encode()) for i in ids)],
                list(ids))

    def expire(self, ids: list):
        """End as expired the jobs among ``ids`` (the head of the expiring set) past their expires_at."""
        k = self.k
        return ("expire", [k.expiring, k.queue, k.deferred, k.counts, k.sched, *k.fair_keys, *self._per_member(ids)],
                [self.s.result_ttl_s, self.pubcmd, *ids])

    def pick(self, n: int):
        """Choose up to ``n`` queued jobs, fairly between API keys within a tier (pick.lua)."""
        k = self.k
        return ("pick", [k.queue, k.policy, *k.fair_keys], [n])

    def pull(self, members: list, worker_id: str):
        """Lease the jobs among ``members``, as ``pick`` chose them."""
        k = self.k
        return ("pull", [k.queue, k.inflight, k.counts, k.dead, k.dead_info, k.sched, k.policy, k.fair_state,
                         *self._per_member(members)],
                [len(members), self.s.lease_s, worker_id, self.s.result_ttl_s, self.pubcmd, *members])

    def deltas(self, items: list[tuple[str, str, bytes, int]]):
        """Append and publish ``(job id, owner token, delta, sequence number)`` items, each fenced on
        its job's lease owner; a delta numbered no higher than the last its owner wrote is skipped
        (deltas.lua: a resend)."""
        k = self.k
        keys: list = []
        args: list = [self.pubcmd]
        for job_id, owner, payload, seq in items:
            keys += [k.job(job_id), k.events(job_id), k.channel(job_id)]
            args += [owner, payload, seq]
        return ("deltas", keys, args)

    def complete(self, job_id: str, owner: str, status: str, result: bytes, final_delta: bytes,
                 usage: tuple[int, int] = (0, 0)):
        """``usage``: the job's (prompt, completion) tokens, counted for its API key (ModelKeys.usage)."""
        k = self.k
        return (
            "complete",
            [k.job(job_id), k.inflight, k.counts, k.events(job_id), k.done(job_id), k.channel(job_id), k.sched,
             k.policy, *k.fair_keys],
            [job_id, owner, status, result, self.s.result_ttl_s, final_delta, self.pubcmd, *usage],
        )

    def requeue(self, job_id: str, owner: str, resume: bytes = b"", error: str = ""):
        """``error``: the worker failed while it held the job; the attempt counts and its lease ends
        now (requeue.lua), for ``reap`` to requeue or dead-letter it."""
        k = self.k
        return ("requeue", [k.job(job_id), k.inflight, k.queue, k.counts, k.wake, k.events(job_id), k.done(job_id),
                            k.channel(job_id), k.sched, k.policy, *k.fair_keys],
                [job_id, owner, resume, error, self.s.result_ttl_s, self.pubcmd])

    def cancel(self, job_id: str, mode: str = "queue"):
        """``mode``: 'queue' (workers, trusted clients) or 'worker' (acting on a cancel request)."""
        k = self.k
        return (
            "cancel",
            [k.queue, k.job(job_id), k.counts, k.events(job_id), k.done(job_id), k.cancel_channel,
             k.channel(job_id), k.sched, k.fair_state],
            [job_id, self.pubcmd, mode, self.s.result_ttl_s],
        )

    def renew(self, leases: dict[str, str], worker_id: str = ""):
        """Renew ``leases``; with ``worker_id``, beat for that worker too (``ModelKeys.beats``)."""
        args: list = [self.s.lease_s, worker_id, self.s.takeover_after_s]
        keys = [self.k.inflight, self.k.beats]
        for job_id, owner in leases.items():
            args += [job_id, owner]
            keys.append(self.k.job(job_id))
        return ("renew", keys, args)

    def reap(self, candidates: list, forget: list = ()):
        """Requeue or dead-letter ``candidates`` (in-flight members whose lease looked expired, or
        whose owner's beat looked overdue); drop the beats of ``forget`` (overdue workers that hold
        nothing)."""
        k = self.k
        return ("reap", [k.inflight, k.queue, k.counts, k.dead, k.dead_info, k.wake, k.sched, k.beats, k.policy,
                         *k.fair_keys, *self._per_member(candidates)],
                [self.s.max_attempts, self.s.result_ttl_s, self.pubcmd, len(forget), *forget, *candidates])


LIFE_FIELDS = ("run_at", "expires_at", "webhook")


def life_args(request: bytes) -> list[str]:
    """The request's ``run_at``, ``expires_at`` and ``webhook`` as the enqueue and submit scripts take
    them (ARGV 7-9, '' for none): read from the request itself, so the record and the scripts agree."""
    try:
        req = codec.unpack(request)
    except Exception:  # noqa: BLE001 - a request this side cannot read: the worker refuses it, not the enqueue
        return ["", "", ""]
    if not isinstance(req, dict):
        return ["", "", ""]
    return ["" if req.get(f) is None else str(req[f]) for f in LIFE_FIELDS]  # (a bad time: the script says so)


def owner_token(worker_id: str, attempt: int) -> str:
    return f"{worker_id}:{attempt}"


def owner_worker(token: str) -> str:
    """The worker id in an owner token ('' for a token that is none)."""
    wid, _, attempt = token.rpartition(":")
    return wid if attempt.isdigit() else ""


class Reaped(NamedTuple):
    requeued: int
    dead: int
    cancelled: int
    taken_over: int  # of those three, the jobs taken from a worker whose heartbeat was overdue


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
        # A producer whose ACL allows FCALL but not EVALSHA (see docs/operations/acl.md, the trust boundary) switches to
        # mlxq's Functions, and to the intake list (it may not write the queue).
        self.functions = False

    def run(self, call, client=None, read_only: bool = False):
        try:
            return run_script(client or self.redis, self._scripts, call, self.functions, read_only)
        except ResponseError as exc:
            if self.functions:
                fcall_failed(exc)
            raise

    def queue_call(self, pipe, call) -> None:
        """Put a script call on a pipeline as a bare EVALSHA (or FCALL).  redis-py's own script objects
        would send SCRIPT EXISTS in a round trip of its own at every ``execute``: a hot path (the
        worker's publisher, once per step) instead re-sends the calls a NOSCRIPT reply refused, after
        ``load_scripts`` (a Redis restarted without its script cache)."""
        name, keys, args = call
        if self.functions:
            pipe.fcall(function_name(name), len(keys), *keys, *args)
        else:
            pipe.evalsha(self._scripts[name].sha, len(keys), *keys, *args)

    def load_scripts(self) -> None:
        for script in self._scripts.values():
            script.sha = self.redis.script_load(script.script)

    def enqueue(self, job_id, request: bytes, key_hash: str | None = None, floor: str | None = None,
                idempotency_key=None, global_redis=None) -> Enqueued:
        """``enqueue_steps``, run here.  ``global_redis`` (a client that reaches the global keys) lets a
        trusted caller copy the key registry into a model's slot that has none yet."""
        def do(op):
            if isinstance(op, CopyPolicy):
                return copy_policy(global_redis, self.redis, self.keys)
            return self._run_acked(op.call, op.acked) if op.acked else self.run(op.call, read_only=op.read_only)

        return run_steps(enqueue_steps(self, self.calls, job_id, request, key_hash, floor, idempotency_key), do)

    def _run_acked(self, call, job_id: str):
        """``run``, then, with ``submit_replica_ack_ms`` set, ``WAIT 1 <ms>`` on the same connection:
        the submit returns once one replica has the job (or the wait ran out: a warning)."""
        wait_ms = self.settings.submit_replica_ack_ms
        if not wait_ms:
            return self.run(call)
        with one_connection(self.redis) as conn:
            reply = self.run(call, client=conn)
            acked = conn.execute_command("WAIT", 1, wait_ms)
        replica_acked(acked, job_id, wait_ms)
        return reply

    def admit(self, limit: int = 1000) -> tuple[int, int]:
        """Place what producers under the ACL recipe left on the intake list (a worker's job)."""
        ids = self.redis.lrange(self.keys.intake, 0, limit - 1)
        if not ids:
            return 0, 0
        admitted, refused = self.run(self.calls.admit(ids))
        return int(admitted), int(refused)

    def pull(self, n: int, worker_id: str) -> list[Pulled]:
        """Queue the deferred jobs that are due, admit what waits on the intake list, then lease up to ``n``
        jobs: the lowest scores across tiers, by turns between API keys within a tier (``pick``).
        Promote, admit and pull are given the members they may touch (read or chosen first), so every key
        is declared."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.lrange(self.keys.intake, 0, 999)
        pipe.time()
        pipe.zrange(self.keys.deferred, 0, 99, withscores=True)  # the earliest run_at first
        intake, (sec, usec), deferred = pipe.execute()
        # deferred jobs whose run_at has come join the queue first (promote.lua; it checks the time again)
        due = [m for m, run_at in deferred if run_at <= sec + usec / 1e6]
        if due:
            self.run(self.calls.promote(due))
        if intake:
            self.run(self.calls.admit(intake))
        members = self.run(self.calls.pick(n))
        if not members:
            return []
        return parse_pull(self.run(self.calls.pull(members, worker_id)))

    def complete(self, job_id, owner, status, result: bytes, final_delta: bytes = b"", client=None,
                 usage: tuple[int, int] = (0, 0)):
        return self.run(self.calls.complete(job_id, owner, status, result, final_delta, usage), client)

    def requeue(self, job_id, owner, resume: bytes = b"", client=None, error: str = ""):
        return self.run(self.calls.requeue(job_id, owner, resume, error), client)

    def cancel(self, job_id: str, mode: str = "queue") -> str:
        return run_steps(cancel_steps(self, self.calls, job_id, mode), lambda op: self.run(op.call))

    def renew(self, leases: dict[str, str]) -> tuple[list[str], list[str]]:
        if not leases:
            return [], []
        lost, cancel, _ = self.heartbeat("", leases)
        return lost, cancel

    def heartbeat(self, worker_id: str, leases: dict[str, str]) -> tuple[list[str], list[str], float]:
        """Beat for ``worker_id`` (it vouches for the worker for ``takeover_after_s``) and renew its
        leases: (lost ids, ids flagged for cancelling, seconds the beat came after its last one had
        run out, 0 when on time)."""
        lost, cancel, late = self.run(self.calls.renew(leases, worker_id))
        return [_s(x) for x in lost], [_s(x) for x in cancel], _f(late)

    # past this many running jobs, a takeover scan reads only the leases that run out first
    TAKEOVER_SCAN = 10_000

    def reap(self, limit: int = 100) -> Reaped:
        """Requeue (or dead-letter) jobs whose lease expired by the server's clock, and take over the
        jobs of workers whose heartbeat is overdue (``ModelKeys.beats``): those are read only while a
        worker is overdue, which is rare (a death), and its beat is forgotten once it holds nothing."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.time()
        pipe.zrange(self.keys.inflight, 0, limit - 1, withscores=True)
        pipe.zrange(self.keys.beats, 0, -1, withscores=True)  # one member a worker of this model
        (sec, usec), leases, beats = pipe.execute()
        now = sec + usec / 1e6
        candidates = [m for m, deadline in leases if deadline <= now]
        overdue = {_s(w) for w, vouched in beats if vouched <= now}
        forget: list[str] = []
        if overdue:
            running = self.redis.zrangebyscore(self.keys.inflight, f"({now}", "+inf", 0, self.TAKEOVER_SCAN)
            pipe = self.redis.pipeline(transaction=False)
            for m in running:
                pipe.hget(self.keys.job_prefix.encode() + (m if isinstance(m, bytes) else str(m).encode()), "owner")
            # (a job key of another type, forged: no owner; the reaper's lease check meets it)
            holders = [owner_worker("" if isinstance(o, Exception) else _s(o))
                       for o in pipe.execute(raise_on_error=False)] if running else []
            candidates += [m for m, wid in zip(running, holders) if wid in overdue]
            forget = sorted(overdue - set(holders))
        self.sweep_expired(now, limit)
        if not candidates and not forget:
            return Reaped(0, 0, 0, 0)
        total = [0, 0, 0, 0]
        for i in range(0, max(1, len(candidates)), limit):
            reply = self.run(self.calls.reap(candidates[i:i + limit], forget if i == 0 else ()))
            total = [a + int(b) for a, b in zip(total, reply)]
        return Reaped(*total)

    def sweep_expired(self, now: float, limit: int = 100) -> int:
        """End as expired the jobs never started whose expires_at is past ``now`` (the server's clock),
        wherever they wait (expire.lua): the reaper's sweep, so a job nobody pulls still ends."""
        ids = self.redis.zrangebyscore(self.keys.expiring, "-inf", now, 0, limit)
        return int(self.run(self.calls.expire(ids))) if ids else 0

    def counts(self) -> dict[str, int]:
        return {_s(k): int(v) for k, v in self.redis.hgetall(self.keys.counts).items()}
