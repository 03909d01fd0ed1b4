"""Redis I/O threads of a worker, so that Redis never stalls a decode step.

* ``Publisher``: one pipelined round trip per step for all deltas and
  completions of that step, in order; on a connection error it keeps the
  batch and retries with capped backoff (nothing is dropped).
* ``Fetcher``: pulls as many jobs as there are free slots, decodes, validates
  and tokenizes them off the MLX thread; when idle it blocks on the queue's
  wake-up list, then waits a short window to gather a batch.
* ``Control``: the heartbeat (which vouches for the worker and renews its
  leases), reaping of expired leases and of overdue workers' jobs, stats, the
  model registry, and the cancel channel.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import redis
from redis.backoff import FullJitterBackoff
from redis.exceptions import NoScriptError

from ..shared import apikeys, codec
from ..shared.connection import RESLOT_ERRORS
from ..shared.keys import GlobalKeys
from ..shared.protocol import Queue, load_functions, owner_token
from ..shared.schemas import JOB_ID

log = logging.getLogger(__name__)

# A lost link, a restarting Redis, or a cluster failover (MOVED, CLUSTERDOWN, READONLY): retry with backoff.
REDIS_ERRORS = (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError, OSError) + RESLOT_ERRORS
# Error replies by which the server refuses a write for its own state, not the call's: at maxmemory
# with noeviction (OOM), after a failed background save (MISCONF), a script running too long (BUSY),
# too few replicas (NOREPLICAS). They pass; the publisher sends the call again later.
SERVER_NOT_NOW = ("OOM", "MISCONF", "BUSY", "NOREPLICAS")


def _not_now(reply) -> bool:
    """A reply that refused the call for now (it never ran, or ran only where a resend skips it)."""
    if isinstance(reply, (NoScriptError, redis.exceptions.OutOfMemoryError) + REDIS_ERRORS):
        return True  # (redis-py takes the OOM code off the message: its own class says it)
    return isinstance(reply, redis.ResponseError) and str(reply).split(" ", 1)[0] in SERVER_NOT_NOW


class Backoff:
    """Capped exponential backoff, as rq's worker does for ConnectionError, with full jitter (redis-py's
    ``FullJitterBackoff``: a delay drawn from [0, min(cap, first * 2**failures)]): after a restart every
    worker and producer retried on the same beat, all at once."""

    def __init__(self, first: float = 0.05, cap: float = 1.0):
        self.first, self.cap, self.failures = first, cap, 0
        self._jitter = FullJitterBackoff(cap=cap, base=first)

    def fail(self) -> float:
        delay = self._jitter.compute(self.failures)
        self.failures += 1
        return delay

    def ok(self) -> None:
        self.failures = 0


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
    completions: list[tuple[str, str, str, bytes, bytes]] = field(default_factory=list)
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
        """Pack what add_delta gathered into ``deltas``, numbered (Publisher.submit does it)."""
        for job_id, (owner, wires) in self._staged.items():
            self.deltas.append((job_id, owner, codec.pack(wires[0] if len(wires) == 1 else wires), next_delta_seq()))
        self._staged.clear()
        return self

    def __bool__(self) -> bool:
        return bool(self.deltas or self.completions or self.requeues or self.abandons)


class Publisher(threading.Thread):
    def __init__(self, q: Queue, stop: threading.Event):
        super().__init__(name="mlxq-publisher", daemon=True)
        self.q = q
        self.stop_event = stop
        self.inbox: "queue.Queue[StepOutput]" = queue.Queue()
        self.round_trips = 0
        self.backoff = Backoff()
        self.on_fenced: Optional[Callable[[str, str, bool], None]] = None
        # (job id, owner token) of jobs whose deltas could not be written at all (an error no resend
        # cures): the worker drops them, so that their leases lapse and the next attempt resumes from
        # what the stream holds. Publishing past the hole left their streams with a gap no reader fills.
        self.on_gave_up: Optional[Callable[[list[tuple[str, str]]], None]] = None

    def submit(self, out: StepOutput) -> None:
        if out.seal():
            self.inbox.put(out)

    def drain(self, timeout: float) -> bool:
        """Wait until everything submitted has reached Redis (shutdown)."""
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
        jobs: they are left to their leases, which lapse, and the reaper queues them again. Before,
        the exception ended this thread, and nothing more reached Redis while the worker ran on."""
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
        if leases and self.on_gave_up is not None:
            try:
                self.on_gave_up(leases)
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
            # server's own OOM, MISCONF, BUSY); they go again, in order, as on a lost link. Before, the
            # second kind was logged and dropped: a job's deltas of that step were lost from its stream.
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
            for job_id, owner, status, result, final in out.completions:
                calls.append((self.q.calls.complete(job_id, owner, status, result, final), job_id, "complete", []))
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


class Fetcher(threading.Thread):
    """Pulls jobs off the MLX thread. ``prepare`` turns a Pulled entry into a ready item."""

    def __init__(self, q: Queue, worker_id: str, free_slots: Callable[[], int],
                 prepare: Callable[[Any], None], stop: threading.Event, gather_s: float, idle_block_s: float,
                 urgent_below: Optional[Callable[[], float]] = None):
        super().__init__(name="mlxq-fetcher", daemon=True)
        self.q = q
        self.worker_id = worker_id
        self.free_slots = free_slots
        # while no slot is free: a queued job scoring below urgent_below() would preempt, so pull it
        self.urgent_below = urgent_below
        self.prepare = prepare
        self.stop_event = stop
        self.paused = threading.Event()  # set on warm shutdown: pull nothing more
        self.pulling = threading.Lock()  # held from a pull until its jobs are prepared (pause)
        self.gather_s = gather_s
        self.idle_block_s = idle_block_s
        self.kick = threading.Event()  # set by the MLX thread when slots free up
        self.backoff = Backoff()
        self.pulls = 0
        self.clock_offset = 0.0
        # job id -> owner: jobs of the pull being prepared, leased here but in no queue of the
        # worker yet; the heartbeat renews them too (a pull of large prompts can take longer to
        # tokenize than a lease lasts, and the reaper would queue jobs this worker goes on to run)
        self.preparing: dict[str, str] = {}

    def run(self) -> None:
        idle = True
        while not self.stop_event.is_set() and not self.paused.is_set():
            try:
                want = self.free_slots()
                if want <= 0 and self._urgent_waiting():
                    want = 1
                if want <= 0:
                    self.kick.wait(0.05)
                    self.kick.clear()
                    continue
                if idle:
                    # Block on the wake-up signal rather than polling, then gather a batch.
                    woke = self.q.redis.blpop([self.q.keys.wake], timeout=self.idle_block_s)
                    if self.paused.is_set():
                        break
                    if woke and self.gather_s > 0:
                        time.sleep(self.gather_s)
                    want = self.free_slots()
                    if want <= 0:
                        continue
                with self.pulling:
                    if self.paused.is_set():
                        break
                    local = time.time()
                    pulled = self.q.pull(want, self.worker_id)
                    self.backoff.ok()
                    if pulled:
                        self.clock_offset = pulled[0].now - local
                        self.pulls += 1
                        self.preparing.update({e.job_id: owner_token(self.worker_id, e.attempt)
                                               for e in pulled if e.kind == "job"})
                        try:
                            for entry in pulled:
                                self._prepare_one(entry)
                                self.preparing.pop(entry.job_id, None)
                        finally:
                            self.preparing.clear()
                # Under load (we got a full pull) never wait; otherwise go idle, unless the pull came
                # back short because it dropped stale members and the queue still holds more.
                idle = len(pulled) < want and self.q.redis.zcard(self.q.keys.queue) == 0
            except REDIS_ERRORS as exc:
                delay = self.backoff.fail()
                log.warning("pull failed (%s); retrying in %.2fs", exc, delay)
                time.sleep(delay)
            except Exception:  # never let the fetcher die on one bad entry
                log.exception("fetcher error")
                time.sleep(0.1)

    def _prepare_one(self, entry) -> None:
        """``prepare``, whose failure costs this entry alone, not the rest of its pull: those are
        leased to this worker and, skipped, would wait for their leases to lapse and count an
        attempt. ``prepare`` fails a bad job itself; what still escapes (a bug, or a panic from a
        Rust library, which is a BaseException) leaves this one to its lease."""
        try:
            self.prepare(entry)
        except REDIS_ERRORS:
            raise  # the worker is stopping (prepare retries through lost links until then)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException:
            log.exception("job=%s: preparing it failed; it comes back when its lease lapses", entry.job_id)

    def pause(self, timeout: float = 10.0) -> None:
        """Pull nothing more, and wait until a pull under way has handed its jobs over (``prepare``):
        a job leased but not yet in the ready queue when the worker gives its jobs back would otherwise
        wait for its lease to expire, and then count an attempt it never had."""
        self.paused.set()
        if self.pulling.acquire(timeout=timeout):
            self.pulling.release()
        else:
            log.warning("a pull still under way after %.0fs; its jobs come back when their leases expire", timeout)

    def _urgent_waiting(self) -> bool:
        """True when the head of the queue is urgent enough to preempt a running job here."""
        if self.urgent_below is None:
            return False
        below = self.urgent_below()
        if below == float("-inf"):
            return False
        head = self.q.redis.zrange(self.q.keys.queue, 0, 0, withscores=True)
        return bool(head) and head[0][1] < below


class Control(threading.Thread):
    """Heartbeat, lease renewal, reaping, stats and the model registry."""

    def __init__(self, q: Queue, worker_id: str, leases: Callable[[], dict[str, str]],
                 on_lost: Callable[[list[tuple[str, str]]], None], on_cancel: Callable[[list[str]], None],
                 snapshot: Callable[[], dict], model_info: dict, registry_key: str, stop: threading.Event,
                 global_redis=None, watchdog=None, on_stall: Optional[Callable[[], None]] = None):
        super().__init__(name="mlxq-control", daemon=True)
        self.q = q
        self.worker_id = worker_id
        self.leases = leases
        self.on_lost = on_lost
        self.on_cancel = on_cancel
        self.snapshot = snapshot
        self.model_info = model_info
        self.registry_key = registry_key
        self.global_redis = global_redis if global_redis is not None else q.redis  # keys of no model
        self.stop_event = stop
        self.backoff = Backoff()
        self.reaped = [0, 0, 0]
        self._seeded = False
        self._prepared = False
        self.publish_soon = threading.Event()  # set by the worker when a job finished: publish stats now
        # a stuck engine (worker.watchdog): no more beats or renewals, and on_stall (once)
        self.watchdog = watchdog
        self.on_stall = on_stall
        self.stalled = False

    def run(self) -> None:
        s = self.q.settings
        next_beat = next_admit = next_stats = next_reap = 0.0
        pubsub = None
        while not self.stop_event.is_set():
            now = time.monotonic()
            if self.watchdog is not None and not self.watchdog.check():
                if not self.stalled and self.on_stall is not None:
                    try:
                        self.on_stall()
                    except Exception:
                        log.exception("handling the stuck engine failed; no lease is renewed from now on")
                self.stalled = True
            elif now >= next_beat:
                # First and on its own: no failure of the rest of the loop (a policy sync, a cancel,
                # stats) may keep the leases from being renewed (they would lapse, and the reaper
                # would queue running jobs again).
                try:
                    self.renew()
                    next_beat = now + s.heartbeat_s
                except REDIS_ERRORS:
                    pass  # the loop below meets it too, reports it and backs off
                except Exception:
                    log.exception("renewing the leases failed")
            try:
                if not self._prepared:
                    self.prepare()
                if pubsub is None:
                    pubsub = self.q.redis.pubsub(ignore_subscribe_messages=True)
                    if self.q.cluster:
                        pubsub.ssubscribe(self.q.keys.cancel_channel)
                    else:
                        pubsub.subscribe(self.q.keys.cancel_channel)
                msg = pubsub.get_message(timeout=0.1)
                if msg and msg.get("type") in ("message", "smessage"):
                    self._cancel_message(msg["data"])
                now = time.monotonic()
                if now >= next_admit:
                    self.q.admit()  # jobs from producers that may not write the queue, placed within a beat
                    next_admit = now + s.heartbeat_s
                if now >= next_stats or self.publish_soon.is_set():
                    self.publish_soon.clear()
                    self.publish_stats()
                    next_stats = now + s.stats_interval_s
                if now >= next_reap:
                    self.reap()
                    # often enough that a dead worker's jobs are taken over within a second or a beat
                    # of its heartbeat running out (takeover_after_s): a pass that finds nothing due is
                    # one round trip of three reads
                    next_reap = now + min(1.0, s.heartbeat_s)
                self.backoff.ok()
            except REDIS_ERRORS as exc:
                delay = self.backoff.fail()
                log.warning("control loop: redis unavailable (%s); retrying in %.2fs", exc, delay)
                if hasattr(self.q.redis, "invalidate"):  # a cluster: find the slot's master again
                    self.q.redis.invalidate()
                try:
                    if pubsub is not None:
                        pubsub.close()
                except Exception:
                    pass
                pubsub = None
                time.sleep(delay)
            except Exception:
                log.exception("control loop error")
                time.sleep(0.5)
        try:
            if pubsub is not None:
                pubsub.close()
        except Exception:
            pass

    def _cancel_message(self, data) -> None:
        """A job id on the cancel channel: a producer without queue access flagged a queued job (a
        worker takes it out) or a running one (its worker ends it). Anyone who may publish there can
        send anything: what is not a job id, or fails as one (a record that is not a job's), is logged
        and dropped here. Raised into the loop, each such message skipped admission, stats and the
        reaper for half a second."""
        job_id = data.decode("utf-8", "replace") if isinstance(data, bytes) else str(data)
        if not JOB_ID.fullmatch(job_id):
            log.warning("cancel channel: %r is not a job id; ignored", job_id[:80])
            return
        try:
            self.q.cancel(job_id, mode="worker")
        except REDIS_ERRORS:
            raise
        except Exception as exc:  # noqa: BLE001 - e.g. WRONGTYPE: a key that is not a job record
            log.warning("job=%s attempt=%d cancel request failed: %s", job_id, 0, exc)
            return
        self.on_cancel([job_id])

    def renew(self) -> None:
        """Renew this worker's leases; tell the worker of those it lost (job id and the owner token that
        lost it: by the time the worker acts, it may hold the job again under a newer lease) and of
        cancelled jobs."""
        leases = self.leases()
        lost, cancel, late = self.q.heartbeat(self.worker_id, leases)
        if late:
            # (a stalled process, a paused VM, a lost link): another worker's reaper may have taken
            # this worker's jobs meanwhile; those come back as lost leases here and are dropped, and
            # the worker serves on
            log.warning("heartbeat %.1fs late: other workers may have taken over this worker's jobs", late)
        if lost:
            log.warning("leases lost for %d jobs: %s", len(lost), lost[:5])
            self.on_lost([(job_id, leases[job_id]) for job_id in lost if job_id in leases])
        if cancel:
            self.on_cancel(cancel)

    def reap(self) -> None:
        requeued, dead, cancelled, taken = self.q.reap()
        if requeued or dead or cancelled:
            log.warning("reaped %d jobs (%d of a worker whose heartbeat was overdue, the rest of expired leases): "
                        "%d requeued, %d dead-lettered, %d cancelled", requeued + dead + cancelled, taken,
                        requeued, dead, cancelled)
            self.reaped = [a + b for a, b in zip(self.reaped, (requeued, dead, cancelled))]

    def prepare(self) -> None:
        """Load mlxq's Redis Functions (for ACL-restricted producers) and copy the key registry and
        tier policy into this model's slot, before anything is admitted."""
        try:
            load_functions(self.q.redis)
        except redis.ResponseError as exc:  # e.g. a managed Redis without FUNCTION: scripts still work
            log.warning("could not load mlxq's Redis Functions (%s): ACL-restricted producers cannot submit", exc)
        self.sync_policy()
        self._prepared = True

    def sync_policy(self) -> None:
        """Keep this model's slot copy of the key registry and tier policy current."""
        gk = GlobalKeys(self.q.keys.prefix)
        if not self._seeded:
            apikeys.seed_policy(self.global_redis, gk, self.q.settings.tier_offsets, self.q.settings.max_queued_per_tier)
            self._seeded = True
        if apikeys.sync_if_stale(self.global_redis, self.q.redis, gk, self.q.keys.model):
            log.info("copied the API-key registry and tier policy into model %s's slot", self.q.keys.model)

    def publish_stats(self) -> None:
        self.sync_policy()
        s = self.q.settings
        k = self.q.keys
        snap = self.snapshot()
        ttl = max(3, int(s.stats_interval_s * 5))
        pipe = self.q.redis.pipeline(transaction=False)
        pipe.hset(k.worker(self.worker_id), mapping={"s": codec.pack(snap)})
        pipe.expire(k.worker(self.worker_id), ttl)
        pipe.zadd(k.workers, {self.worker_id: time.time()})
        pipe.zremrangebyscore(k.workers, "-inf", time.time() - 60)
        pipe.execute()
        # the model registry is a global key (another slot on a cluster)
        self.global_redis.hset(self.registry_key, self.model_info["name"],
                               codec.pack({**self.model_info, "seen_at": time.time()}))

    def unregister(self) -> None:
        try:
            self.q.redis.zrem(self.q.keys.workers, self.worker_id)
            self.q.redis.zrem(self.q.keys.beats, self.worker_id)  # (its jobs were given back)
            self.q.redis.delete(self.q.keys.worker(self.worker_id))
        except REDIS_ERRORS:
            pass


class ReadyQueue:
    """Prepared jobs waiting for the MLX thread; guarded so slot counts stay exact."""

    def __init__(self):
        self.lock = threading.Lock()
        self.items: deque = deque()
        self.event = threading.Event()

    def put(self, *items) -> None:
        """Items that go together (the samples of a job) arrive together."""
        with self.lock:
            self.items.extend(items)
        self.event.set()

    def __len__(self) -> int:
        return len(self.items)
