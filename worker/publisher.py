"""The publisher thread: one pipelined round trip per step for all deltas and completions of that
step, in order; on a connection error it keeps the batch and retries with capped backoff (nothing is
dropped)."""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import redis
from redis.exceptions import NoScriptError

from ..shared import codec
from ..shared.protocol import Queue
from ..shared.linkwatch import Backoff
from .redis_io import REDIS_ERRORS

log = logging.getLogger(__name__)

# Error replies by which the server refuses a write for its own state, not the call's: at maxmemory
# with noeviction (OOM), after a failed background save (MISCONF), a script running too long (BUSY),
# too few replicas (NOREPLICAS). They pass; the publisher sends the call again later.
SERVER_NOT_NOW = ("OOM", "MISCONF", "BUSY", "NOREPLICAS")


def _not_now(reply) -> bool:
    """A reply that refused the call for now (it never ran, or ran only where a resend skips it)."""
    if isinstance(reply, (NoScriptError, redis.exceptions.OutOfMemoryError) + REDIS_ERRORS):
        return True  # (redis-py takes the OOM code off the message: its own class says it)
    return isinstance(reply, redis.ResponseError) and str(reply).split(" ", 1)[0] in SERVER_NOT_NOW


# Each delta's sequence number (deltas.lua skips one its owner wrote already: a publish sent again after
# its reply was lost). One counter for the process, from the clock in microseconds, so that a worker
# restarted under the same id and owner token still counts above what it wrote before.
_delta_seq = itertools.count(time.time_ns() // 1000)


def next_delta_seq() -> int:
    return next(_delta_seq)


def _leases_of(deltas) -> list[tuple[str, str]]:
    """The (job id, owner token) of each job among ``StepOutput.deltas`` items, once."""
    return sorted({(d[0], d[1]) for d in deltas})


@dataclass
class StepOutput:
    """What one engine step hands to Redis, in order."""

    # (job id, owner token, msgpack payload, sequence number): appended and published fenced on the
    # lease, once; the payload is one delta, or the list of a job's samples' deltas of this step (add_delta)
    deltas: list[tuple[str, str, bytes, int]] = field(default_factory=list)
    # (job id, owner token, status, result record, final delta, (prompt, completion) tokens for its key's usage)
    completions: list[tuple[str, str, str, bytes, bytes, tuple[int, int]]] = field(default_factory=list)
    requeues: list[tuple[str, str, bytes]] = field(default_factory=list)
    # (job id, owner token, error): jobs given up by a worker whose engine raised; the attempt counts
    abandons: list[tuple[str, str, str]] = field(default_factory=list)
    # job id -> [owner, wire deltas]: what add_delta gathered, packed by seal()
    _staged: dict[str, list] = field(default_factory=dict, repr=False)

    def add_delta(self, job_id: str, owner: str, wire: dict) -> None:
        """A job's delta of this step. The samples of a job with n > 1 each make one a step: they go
        out as one payload (a msgpack list, ``shared.schemas.wire_deltas``), so one stream entry and
        one pub/sub message, not n, and a subscriber wakes once a step for the job."""
        staged = self._staged.get(job_id)
        if staged is None:
            self._staged[job_id] = [owner, [wire]]
        else:
            staged[1].append(wire)

    def seal(self) -> "StepOutput":
        """Pack what add_delta gathered into ``deltas``, numbered (Publisher.publish does it)."""
        for job_id, (owner, wires) in self._staged.items():
            self.deltas.append((job_id, owner, codec.pack(wires[0] if len(wires) == 1 else wires), next_delta_seq()))
        self._staged.clear()
        return self

    def __bool__(self) -> bool:
        return bool(self.deltas or self.completions or self.requeues or self.abandons)


class Publisher(threading.Thread):
    def __init__(self, q: Queue, stop: threading.Event, loop_inbox=None):
        super().__init__(name="mlxq-publisher", daemon=True)
        self.q = q
        self.stop_event = stop
        self.inbox: "queue.Queue[StepOutput]" = queue.Queue()
        self.round_trips = 0
        self.backoff = Backoff()
        self.on_fenced: Optional[Callable[[str, str, bool], None]] = None
        # the MLX loop's inbox (worker.inbox): the (job id, owner token) of jobs whose deltas could not
        # be written at all (an error no resend cures) go there as lost leases, and the worker drops
        # them, so that their leases lapse and the next attempt resumes from what the stream holds
        # (publishing past the hole would leave their streams with a gap no reader fills)
        self.loop_inbox = loop_inbox

    def publish(self, out: StepOutput) -> None:
        """Hand a step's writes to the publisher thread, which sends them after every step before it."""
        if out.seal():
            self.inbox.put(out)

    def drain(self, timeout: float) -> bool:
        """Wait until everything handed to ``publish`` has reached Redis (shutdown)."""
        deadline = time.monotonic() + timeout
        while (self.inbox.unfinished_tasks and time.monotonic() < deadline):
            time.sleep(0.01)
        return not self.inbox.unfinished_tasks

    def run(self) -> None:
        while True:
            try:
                out = self.inbox.get(timeout=0.2)
            except queue.Empty:
                if self.stop_event.is_set():
                    return
                continue
            # Coalesce whatever else is waiting into the same round trip.
            batch = [out]
            while len(batch) < 64:
                try:
                    batch.append(self.inbox.get_nowait())
                except queue.Empty:
                    break
            self._send_safely(batch)
            for _ in batch:
                self.inbox.task_done()

    SEND_TRIES = 3

    def _send_safely(self, batch: list[StepOutput]) -> None:
        """``_send``, which retries through lost links for as long as they last; when it raises what
        no reconnect cures (a reply the client cannot read, an ACL refusal, a value it cannot
        encode), each output is sent alone, a few tries each, so one bad write costs only its own
        jobs: they are left to their leases, which lapse, and the reaper queues them again. This
        thread never ends on a bad write: nothing more would reach Redis while the worker ran on."""
        try:
            self._send(batch)
            return
        except Exception:
            log.exception("publishing %d step(s)' writes failed; trying each alone", len(batch))
        for out in batch:
            for attempt in range(1, self.SEND_TRIES + 1):
                try:
                    self._send([out])
                    break
                except Exception:
                    log.exception("publishing a step's writes failed (try %d)", attempt)
                    time.sleep(0.1 * attempt)
            else:
                jobs = sorted({d[0] for d in out.deltas} | {c[0] for c in out.completions}
                              | {r[0] for r in out.requeues} | {a[0] for a in out.abandons})
                log.error("gave up on a step's writes for job(s) %s: they come back when their leases lapse",
                          ", ".join(jobs) or "(none)")
                self._gave_up(_leases_of(out.deltas))

    def _gave_up(self, leases: list[tuple[str, str]]) -> None:
        if leases and self.loop_inbox is not None:
            try:
                self.loop_inbox.lost(leases)
            except Exception:
                log.exception("handing over the jobs whose deltas were not written failed")

    # deltas per script call: one fenced append + publish for a whole step (or several coalesced)
    DELTAS_PER_CALL = 512

    def _send(self, batch: list[StepOutput]) -> None:
        todo = self._calls(batch)
        while todo:
            try:
                pipe = self.q.redis.pipeline(transaction=False)
                for call, *_ in todo:
                    self.q.queue_call(pipe, call)
                replies = pipe.execute(raise_on_error=False)
                self.round_trips += 1
                self.backoff.ok()
            except REDIS_ERRORS as exc:
                delay = self.backoff.fail()
                log.warning("publish failed (%s); retrying in %.2fs with the batch kept", exc, delay)
                time.sleep(delay)
                continue
            # Refused calls never ran: a lost script cache (NOSCRIPT), or a reply that only says "not
            # now" (READONLY from a demoted master, MOVED, TRYAGAIN, CLUSTERDOWN, LOADING, and the
            # server's own OOM, MISCONF, BUSY); they go again, in order, as on a lost link (dropped, a
            # job's deltas of that step would be missing from its stream).
            again = [_not_now(reply) for reply in replies]
            for (_, job_id, kind, leases), reply, retry in zip(todo, replies, again):
                if not retry:
                    self._settled(job_id, kind, reply, leases)
            refused = [r for r, retry in zip(replies, again) if retry]
            todo = [item for item, retry in zip(todo, again) if retry]
            if any(isinstance(r, NoScriptError) for r in refused):
                # Redis lost its script cache (a restart): load them and send what was refused
                log.info("Redis does not have mlxq's scripts (a new or restarted server): loading them")
                try:
                    self.q.load_scripts()
                except REDIS_ERRORS as exc:  # lost again: as any lost link, retried with the calls kept
                    delay = self.backoff.fail()
                    log.warning("loading the scripts failed (%s); retrying in %.2fs", exc, delay)
                    time.sleep(delay)
            elif refused:
                delay = self.backoff.fail()
                log.warning("publish refused for now (%s); retrying in %.2fs with the calls kept", refused[0], delay)
                if hasattr(self.q.redis, "invalidate"):  # a cluster: find the slot's master again
                    self.q.redis.invalidate()
                time.sleep(delay)

    def _calls(self, batch: list[StepOutput]) -> list[tuple[tuple, str, str, list]]:
        """The batch's writes as (script call, job id, kind, the (job id, owner) of a deltas call's
        deltas), in order: a job's deltas come before its completion or requeue."""
        calls: list[tuple[tuple, str, str, list]] = []
        deltas: list = []

        def flush() -> None:
            for i in range(0, len(deltas), self.DELTAS_PER_CALL):
                part = deltas[i:i + self.DELTAS_PER_CALL]
                calls.append((self.q.calls.deltas(part), "", "deltas", _leases_of(part)))
            deltas.clear()

        for out in batch:
            deltas.extend(out.deltas)
            if out.completions or out.requeues or out.abandons:
                flush()
            for job_id, owner, status, result, final, usage in out.completions:
                calls.append((self.q.calls.complete(job_id, owner, status, result, final, usage), job_id,
                              "complete", []))
            for job_id, owner, resume in out.requeues:
                calls.append((self.q.calls.requeue(job_id, owner, resume), job_id, "requeue", []))
            for job_id, owner, error in out.abandons:
                calls.append((self.q.calls.requeue(job_id, owner, b"", error), job_id, "abandon", []))
        flush()
        return calls

    def _settled(self, job_id: str, kind: str, reply, leases: list) -> None:
        if isinstance(reply, Exception):
            log.error("redis command failed in a publish batch (%s%s): %s", kind, f" of job={job_id}" if job_id else "",
                      reply)
            self._gave_up(leases)  # (a completion or requeue not written: the job's lease lapses)
            return
        if kind == "deltas":
            refused = set()
            for key in reply:
                key = key.decode() if isinstance(key, bytes) else key
                job = key.removeprefix(self.q.keys.job_prefix)
                refused.add(job)
                log.warning("job=%s deltas refused: the lease is no longer ours, or its stream takes no "
                            "writes; the job is dropped here", job)
            # (a lost lease: the job is another worker's now; a stream that takes no writes: its lease
            # lapses and the next attempt meets it again, until the job is dead-lettered)
            self._gave_up([lease for lease in leases if lease[0] in refused])
            return
        ok = reply == 1
        if not ok:
            log.warning("job=%s %s refused: the lease is no longer ours", job_id, kind)
        if self.on_fenced is not None:
            try:
                self.on_fenced(job_id, kind, ok)
            except Exception:  # the worker's bookkeeping: never a reason to send the writes again
                log.exception("job=%s: handling the %s reply failed", job_id, kind)
