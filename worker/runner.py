"""The worker: one process, one model, one thread for every MLX call.

Each pass of the loop reads like a sentence: take control messages, admit
ready jobs, run one engine step, hand the step's tokens over.  What becomes of
them (detokenizing, stop strings, deltas, results: ``_after_step``) runs on the
host thread (``mlxq.worker.hostwork``) while the MLX thread launches the next
step; Redis I/O runs on other threads (``fetcher``, ``publisher``, ``control``).  Neither
stalls a decode step.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import socket
import threading
import time
from collections import deque
from functools import partial
from typing import Optional

import mlx.core as mx

from ..shared import codec
from ..shared.keys import GlobalKeys
from ..shared.protocol import Queue
from ..shared.schemas import INTERNAL_ERROR, INVALID_REQUEST, MAX_N, Delta, Result
from ..shared.settings import Settings
from . import blas
from .jobs import ActiveJob, admit_now, sample_uid
from .hostwork import HostWork
from .inbox import Inbox
from .model import LoadedModel
from .engine.engine import make_engine
from .control import Control
from .fetcher import Fetcher, Preparer, ReadyQueue, ServerClock
from .publisher import Publisher, StepOutput
from .stats import Observers, WorkerStats
from .watchdog import Watchdog

log = logging.getLogger(__name__)

def new_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{os.urandom(3).hex()}"


class Worker:
    def __init__(self, redis_client, loaded: LoadedModel, settings: Settings | None = None, *,
                 engine=None, max_batch: int | None = None, worker_id: str | None = None,
                 grace_s: float | None = None,
                 observers: Optional[list] = None):
        self.settings = settings or Settings.from_env()
        self.loaded = loaded
        self.worker_id = worker_id or new_worker_id()
        gk = GlobalKeys(self.settings.prefix)
        self.keys = gk.model_keys(loaded.name)
        self.q = Queue(redis_client, self.keys, self.settings)
        if engine is None:
            engine = make_engine(loaded, self.settings if max_batch is None else
                                 dataclasses.replace(self.settings, max_batch=max_batch))
        self.engine = engine
        self.grace_s = self.settings.grace_s if grace_s is None else grace_s
        self.eos = set(loaded.eos_token_ids)
        self.observers = Observers(observers)

        # By engine uid (a job with n > 1 has one per sample). Added by the MLX thread (_admit), ended by
        # the host thread (_finish); others take list() copies.
        self.active: dict[str, ActiveJob] = {}
        # The host thread: what becomes of each step's tokens, in step order (inline: MLXQ_HOST_THREAD=0).
        self.host = HostWork(inline=not self.settings.host_thread)
        self._removals: deque[str] = deque()  # host thread -> MLX thread: sequences a stop string ended
        self.ready = ReadyQueue()
        self._isolating = False  # a suspect job waits for the engine to drain, or runs alone (admit_now)
        self._engine_free = self.engine.free_slots()
        self._engine_urgent_below = float("-inf")
        self.inbox = Inbox()  # cancels, timeouts and lost leases, for the MLX thread
        self.stop_event = threading.Event()  # threads exit
        self.draining = threading.Event()  # warm shutdown: finish or requeue, pull nothing
        self._sigterms = 0
        self.stats = WorkerStats(self.worker_id, loaded.name, type(self.engine).__name__,
                                 self.settings.stats_interval_s, self.observers)

        # no step completing for stall_s while jobs run: renew nothing more, exit (control.Heartbeat)
        self.watchdog = Watchdog(self.settings.stall_s)
        self.publisher = Publisher(self.q, self.stop_event, self.inbox)
        clock = ServerClock()
        prepare = Preparer(self.q, loaded, self.settings, self.engine, self.worker_id, self.ready, self.publisher,
                           self.stats, self.stop_event, clock)
        self.fetcher = Fetcher(self.q, self.worker_id, self, prepare, self.stop_event,
                               self.settings.gather_ms / 1000.0, self.settings.idle_block_s, clock)
        self.control = Control.build(self.q, self.worker_id, [self.fetcher, self], self.inbox, self.stats,
                                     model_info={**loaded.info(), "max_new_tokens": self.settings.max_new_tokens},
                                     registry_key=gk.models, stop=self.stop_event, global_redis=redis_client,
                                     watchdog=self.watchdog)

    @property
    def processed(self) -> dict[str, int]:
        return self.stats.processed

    # -- read by the other threads -----------------------------------------
    def free_slots(self) -> int:
        """Fetcher thread: how many jobs to pull."""
        if self.draining.is_set() or self._isolating:  # a suspect job runs alone (admit_now)
            return 0
        with self.ready.lock:
            return self._engine_free - len(self.ready.items)

    def urgent_below(self) -> float:
        """Fetcher thread: a queued job scoring below this would preempt (engine value, refreshed per pass)."""
        if self.draining.is_set() or self._isolating or len(self.ready.items):
            return float("-inf")
        return self._engine_urgent_below

    def leases(self) -> dict[str, str]:
        """Control thread: job id -> owner token of every job admitted or waiting to be."""
        jobs = list(self.active.values()) + list(self.ready.items)
        return {j.id: j.owner for j in jobs if isinstance(j, ActiveJob)}

    # -- the loop ------------------------------------------------------------
    def start_threads(self) -> None:
        log.info("worker %s serving %r (%s); BLAS: %s", self.worker_id, self.loaded.name,
                 type(self.engine).__name__, blas.describe())
        self.publisher.start()
        self.fetcher.start()
        self.control.start()

    def run(self, *, burst: bool = False) -> None:
        """Serve until stopped. ``burst``: return once the queue is empty and all work is done."""
        self.start_threads()
        idle_since: Optional[float] = None
        failure: Optional[str] = None
        try:
            while True:
                self.host.check()
                self._check_threads()
                self._apply_removals()
                self._expire()
                self._handle_control()
                self._admit()
                if self.draining.is_set() and (not self.active or time.monotonic() > self._drain_deadline):
                    break
                if not self.engine.has_work():
                    self.watchdog.idle()
                    self._refresh_snapshot()
                    if burst and not len(self.ready) and self._queue_empty():
                        idle_since = idle_since or time.monotonic()
                        if time.monotonic() - idle_since > 0.3:
                            break
                    else:
                        idle_since = None
                    self.ready.event.wait(0.02)
                    continue
                idle_since = None
                t0 = time.perf_counter()
                self.watchdog.step_started()
                events, preempted = self.engine.step()
                self._hand_over(events, preempted)
                self.watchdog.step_done()
                self.stats.busy_s += time.perf_counter() - t0
                self._refresh_snapshot()
        except Exception as exc:
            # The engine (or the host thread) raised: its state is unknown, so this worker stops, and a
            # supervisor starts a fresh one. What it held goes back with the attempt counted, so that a
            # job that fails every worker ends in the dead-letter set with this error after max_attempts
            # instead of sending workers down one after another for ever.
            failure = f"worker {self.worker_id} failed while it held the job: {type(exc).__name__}: {exc}"[:1000]
            log.exception("the serving loop failed; unfinished jobs go back with this attempt counted "
                          "(dead-lettered after %d attempts)", self.settings.max_attempts)
            raise
        finally:
            self._shutdown(failure)

    def _check_threads(self) -> None:
        """MLX thread: the I/O threads catch what they can; one that died anyway (a bug) leaves a
        worker that looks alive and serves nothing (no pulls, no output, leases lapsing), so the
        worker stops with it, as when the engine fails, and a supervisor starts a fresh one."""
        if self.stop_event.is_set():
            return
        for thread in (self.fetcher, self.publisher, self.control):
            if not thread.is_alive() and not (thread is self.fetcher and self.fetcher.paused.is_set()):
                raise RuntimeError(f"the worker's {thread.name} thread died")

    def _queue_empty(self) -> bool:
        try:
            return self.q.redis.zcard(self.keys.queue) == 0
        except Exception:
            return False

    def _admit(self) -> None:
        done: list[ActiveJob] = []
        # the host thread is handed work only after the lock is let go: it may be waiting for the lock
        # itself (a preempted sample of a job with n > 1 goes back through ready.put), and a full host
        # queue makes submit wait for it
        with self.ready.lock:
            jobs, self._isolating = admit_now(list(self.ready.items), list(self.active.values()))
            taken = {id(j) for j in jobs}
            held = [j for j in self.ready.items if id(j) not in taken]  # wait for a suspect's turn (admit_now)
            self.ready.items.clear()
            self.ready.items.extend(held)
            self.ready.event.clear()
            if jobs:
                if self._isolating and not self.active:
                    log.warning("job=%s attempt=%d runs alone: it was in the engine of a worker that failed (%s)",
                                jobs[0].id, jobs[0].attempt, jobs[0].suspect[:200])
                for job in jobs:
                    self.active[job.uid] = job
                # an earlier attempt published every token, then died before finishing
                done = [j for j in jobs if len(j.tokens) >= j.request.max_tokens]
                finished = {id(j) for j in done}  # nothing left to generate: no prefill for them
                self.engine.add([self._spec(job) for job in jobs if job.uid in self.active and id(job) not in finished])
            self._engine_free = self.engine.free_slots()
            self._engine_urgent_below = self.engine.urgent_below()
        if done:
            self.host.submit(partial(self._finish_done, done))
        if jobs:
            self.fetcher.kick.set()

    def _finish_done(self, jobs: list[ActiveJob]) -> None:
        """Host thread: end jobs whose every token an earlier attempt published."""
        out = StepOutput()
        for job in jobs:
            self._alone(job, out, lambda j=job: self._finish(j, "length", out, j.text.finish()))
        self.publisher.submit(out)

    def _spec(self, job: ActiveJob):
        spec = job.spec(self.loaded.eos_token_ids)
        spec.want_logprobs = bool(job.request.logprobs)
        return spec

    def _hand_over(self, events, preempted) -> None:
        """MLX thread: read what the step's tokens need from MLX (log-probabilities), then hand them to
        the host thread."""
        tops = [None] * len(events)
        for i, ev in enumerate(events):
            job = self.active.get(ev.uid)
            if job is not None and job.request.logprobs and ev.token is not None:
                tops[i] = self._logprobs(ev, job.request.logprobs)
        self.stats.step(len(events))
        if events or preempted:
            self.host.submit(partial(self._after_step, events, preempted, tops))

    def _remove_soon(self, uid: str) -> None:
        """Host thread: drop a sequence from the engine (on the MLX thread, before its next step)."""
        if self.host.inline:
            self.engine.remove([uid])
        else:
            self._removals.append(uid)

    def _apply_removals(self) -> None:
        uids = []
        while self._removals:
            uids.append(self._removals.popleft())
        if uids:
            self.engine.remove(uids)

    def _after_step(self, events, preempted, tops) -> None:
        """Host thread: a step's tokens become text, deltas and results, handed to the publisher."""
        out = StepOutput()
        for ev, top in zip(events, tops):
            job = self.active.get(ev.uid)
            if job is None:
                continue
            # this job's own trouble (a parser, a detokenizer): its own end
            self._alone(job, out, partial(self._take_event, job, ev, top, out))
        for p in preempted:
            job = self.active.get(p.uid)
            if job is not None and job.group is not None:
                # a sample of a job with n > 1 goes back to the ready queue: _admit hands it to the
                # engine again, from the tokens it published (its siblings run on, the job keeps its lease)
                self.ready.put(job)
                continue
            self.active.pop(p.uid, None)
            if job is not None:
                job.tokens = list(p.tokens)
                out.requeues.append((job.id, job.owner, job.resume_state()))
                self.stats.count("requeued")
        self.publisher.submit(out)

    def _take_event(self, job: ActiveJob, ev, top, out: StepOutput) -> None:
        """Host thread: one sequence's token (or its end) of a step: text, a delta or the job's result."""
        if job.first_token_at is None:
            job.first_token_at = job.now()
        if ev.cached_tokens is not None:  # prefix-cache hit tokens (engines that know)
            job.cached_tokens = min(ev.cached_tokens, len(job.prompt))
        finish = ev.finish_reason
        ids: list[int] = []
        text = ""
        lp = None
        if ev.token is None:  # the engine ended the job with no token: its constraint failed
            self._finish(job, finish or "error", out, job.text.finish(), error=ev.error,
                         error_code=INVALID_REQUEST)
            return
        if not (finish == "stop" and ev.token in self.eos):
            self.observers.notify("on_token", job, 1, time.monotonic())
            ids = [ev.token]
            job.tokens.append(ev.token)
            self.stats.tokens_generated += 1
            text = job.text.add(ev.token)
            if job.request.logprobs:
                lp = [top or {"token": ev.token, "logprob": None, "top": []}]
                job.logprobs.extend(lp)
        if job.text.stopped:  # a stop string, also on the token that reached max_tokens
            if finish is None:
                self._remove_soon(job.uid)
            finish = "stop"
        if finish:
            text += job.text.finish()
            self._finish(job, finish, out, text, ids, lp)
        elif text or ids:
            delta = job.emit(text, ids, logprobs=lp)
            out.add_delta(job.id, job.owner, job.wire_dict(delta))

    def _alone(self, job: ActiveJob, out: StepOutput, handle) -> None:
        """Host thread: ``handle()``, one job's part of a step; what it raises ends that job alone."""
        try:
            handle()
        except Exception as exc:
            self._fail_alone(job, out, exc)

    def _fail_alone(self, job: ActiveJob, out: StepOutput, exc: BaseException) -> None:
        """Host thread: handling one job's step raised. That job ends with an internal error (out of
        the engine too), and the rest of the step goes on: before, the exception stopped the worker,
        and every job it held went back with an attempt counted. Where even ending it fails, it goes
        back to the queue with this error (the attempt counts; after max_attempts it is dead-lettered)."""
        error = f"internal error in the worker's host step: {type(exc).__name__}: {exc}"[:1000]
        log.exception("job=%s attempt=%d: %s", job.uid, job.attempt, error)
        self._remove_soon(job.uid)
        try:
            self._finish(job, "error", out, error=error, error_code=INTERNAL_ERROR)
        except Exception:
            log.exception("job=%s: ending it failed too; it goes back to the queue", job.uid)
            for sample in self._samples(job.id):  # this job too, unless _finish took it out already
                self.active.pop(sample.uid, None)
                self._remove_soon(sample.uid)
            out.abandons.append((job.id, job.owner, error))

    def _finish(self, job: ActiveJob, finish: str, out: StepOutput, text: str = "", ids=(), lp=None,
                error: Optional[str] = None, error_code: Optional[str] = None) -> None:
        if finish == "length" and job.text.stopped:
            # the caller's final flush completed a stop string (text held back as an incomplete
            # character decodes only then): the job ended on it, as on any other stop string
            finish = "stop"
        delta = job.emit(text, list(ids), finish, error, lp)
        self.active.pop(job.uid, None)
        result = job.end(finish, error, error_code)
        if result is None:  # other samples of the job still run: this one's last delta is a delta
            out.add_delta(job.id, job.owner, job.wire_dict(delta))
            return
        packed = result.record()
        if len(packed) > codec.MAX_MESSAGE_BYTES:
            result, delta, packed = self._too_large(job, result, delta, len(packed))
        status = {"cancelled": "cancelled", "error": "failed"}.get(result.finish_reason, "done")
        out.completions.append((job.id, job.owner, status, packed, job.wire(delta)))
        self.stats.finished(status)
        self.observers.notify("on_finish", job, result)
        log.info("job=%s attempt=%d finished: %s, %d tokens", job.id, job.attempt, finish, len(job.tokens))

    @staticmethod
    def _too_large(job: ActiveJob, result: Result, delta: Delta, size: int) -> tuple[Result, Delta, bytes]:
        """A result larger than any reader takes (``codec.MAX_MESSAGE_BYTES``: every token's
        log-probabilities of a long job with many samples) ends the job with an error that says so,
        and its final delta with it: a caller got the job "done" and then only a CodecError reading
        it. Its stream still holds every token that went out."""
        limit = codec.MAX_MESSAGE_BYTES
        error = (f"the result is {size:,} bytes, over the {limit:,} a result may be "
                 f"(n {job.request.n}, {len(job.tokens)} tokens a sample"
                 + (f", {job.request.logprobs} log-probabilities a token" if job.request.logprobs else "")
                 + "): ask for fewer tokens, samples or log-probabilities, or read the stream")
        log.warning("job=%s: %s", job.id, error)
        failed = Result(id=result.id, finish_reason="error", error=error, error_code=INVALID_REQUEST,
                        stats=result.stats)
        delta = delta.model_copy(update={"finish_reason": "error", "error": error})
        return failed, delta, failed.record()

    def _logprobs(self, ev, k: int) -> dict:
        lp = ev.logprobs
        if lp is None:
            return {"token": ev.token, "logprob": None, "top": []}
        lp = lp.reshape(-1)
        top = mx.argpartition(-lp, kth=k - 1)[:k]
        top_vals = lp[top]
        order = mx.argsort(-top_vals)
        ids, vals = top[order].tolist(), top_vals[order].tolist()
        return {"token": ev.token, "logprob": lp[ev.token].item(), "top": [[i, v] for i, v in zip(ids, vals)]}

    def _expire(self) -> None:
        """MLX thread: jobs past their ``timeout_s`` (running or waiting to be admitted) end, as a
        cancel does, with finish reason "timeout" and their tokens so far."""
        now = time.monotonic()
        with self.ready.lock:
            jobs = list(self.active.values()) + [j for j in self.ready.items if isinstance(j, ActiveJob)]
        late = [j for j in jobs if j.deadline is not None and not j.timed_out and now >= j.deadline]
        for job in late:
            job.timed_out = True
        if late:
            self.inbox.timeout(sorted({j.id for j in late}))

    def _handle_control(self) -> None:
        for kind, ids in self.inbox.take():
            ended = []
            for item in ids:
                # a lost lease names its owner token: the worker may have pulled the job again since
                # (another worker's reaper requeued it), and that newer lease is not the one lost
                job_id, owner = item if kind == "lost" else (item, None)
                running = [s for s in self._samples(job_id) if owner is None or s.owner == owner]
                waiting = self._take_ready(job_id, owner)
                if running or waiting:
                    self.engine.remove([s.uid for s in running + waiting])
                ended += [(s, True) for s in running] + [(s, False) for s in waiting]
            if ended:
                self.host.submit(partial(self._end_by_control, kind, ended))

    def _end_by_control(self, kind: str, ended: list) -> None:
        """Host thread: end cancelled and timed-out jobs (every sample), drop jobs whose lease another
        worker took (after the tokens of every earlier step; a sample the host thread finished meanwhile
        stays finished)."""
        out = StepOutput()
        for job, running in ended:
            if running and self.active.get(job.uid) is not job:
                continue
            if kind == "cancel":
                self._alone(job, out, partial(self._finish, job, "cancelled", out))
            elif kind == "timeout":  # its tokens so far, and the text they make (nothing held back)
                self._alone(job, out, lambda j=job: self._finish(j, "timeout", out, j.text.finish()))
            else:  # lost lease: another worker owns the job now; write nothing
                self.active.pop(job.uid, None)
                log.warning("job=%s attempt=%d dropped: lease lost", job.uid, job.attempt)
        self.publisher.submit(out)

    def _samples(self, job_id: str) -> list[ActiveJob]:
        """The job's active sequences: the job itself (n == 1), or its samples still running."""
        job = self.active.get(job_id)
        if job is not None:
            return [job]
        return [s for i in range(MAX_N) if (s := self.active.get(sample_uid(job_id, i))) is not None]

    def _drop(self, samples: list[ActiveJob]) -> None:
        """Take sequences out of the engine and of the active set."""
        if samples:
            self.engine.remove([s.uid for s in samples])
        for s in samples:
            self.active.pop(s.uid, None)

    def _take_ready(self, job_id: str, owner: Optional[str] = None) -> list[ActiveJob]:
        with self.ready.lock:
            taken = [item for item in self.ready.items if item.id == job_id and owner in (None, item.owner)]
            for item in taken:
                self.ready.items.remove(item)
        return taken

    # -- stats ---------------------------------------------------------------
    def _refresh_snapshot(self, force: bool = False) -> None:
        if force or self.stats.due_now():
            active = list(self.active.values())  # the host thread ends jobs meanwhile
            self.stats.refresh(active, len(self.ready), self.publisher.round_trips, self.draining.is_set(),
                               self.engine.stats())

    # -- shutdown ------------------------------------------------------------
    _drain_deadline = float("inf")

    def request_stop(self, grace_s: Optional[float] = None) -> None:
        """Warm shutdown: stop pulling; finish active jobs within the grace period, then requeue."""
        self._drain_deadline = time.monotonic() + (self.grace_s if grace_s is None else grace_s)
        self.draining.set()
        self.fetcher.paused.set()

    def install_signal_handlers(self) -> None:
        def handler(signum, frame):
            self._sigterms += 1
            if self._sigterms == 1:
                log.warning("signal %d: warm shutdown (finishing active jobs for up to %.0fs); "
                            "send it again to exit at once", signum, self.grace_s)
                self.request_stop()
            else:
                log.warning("second signal: cold shutdown; leased jobs return to the queue when "
                            "their leases expire")
                os._exit(1)

        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)

    def _shutdown(self, failure: Optional[str] = None) -> None:
        """Stop: publish what is left, give the unfinished jobs back (``failure``: the loop raised, and
        their attempt counts; see ``run``), stop the threads."""
        self.fetcher.pause()  # a pull under way hands its jobs over first: they are given back too
        try:
            self.host.drain()  # every step's tokens published before the leftovers are requeued
        except Exception:
            log.exception("the host thread failed; requeueing what is left")
        self.host.close()
        self._apply_removals()
        out = StepOutput()
        leftovers = list(self.active.values())
        with self.ready.lock:
            leftovers += list(self.ready.items)
            self.ready.items.clear()
        # After a failure, the jobs the engine held are the suspects: their attempt counts. Jobs pulled
        # but not yet handed to it go back as at any stop (a job with n > 1 is a suspect if any of its
        # samples was in the engine).
        suspects = {j.id for j in self.active.values()} if failure else set()
        self._drop(leftovers)
        jobs = list({j.id: j for j in leftovers}.values())  # once per job, whatever its samples
        for job in jobs:
            if job.id in suspects:
                out.abandons.append((job.id, job.owner, failure))
                self.stats.count("abandoned")
            else:
                out.requeues.append((job.id, job.owner, job.resume_state()))
                self.stats.count("requeued")
        if len(jobs) > len(suspects):
            log.warning("requeued %d unfinished jobs at their original scores", len(jobs) - len(suspects))
        self.active.clear()
        self.publisher.submit(out)
        self._refresh_snapshot(force=True)
        if not self.publisher.drain(timeout=30.0):
            log.error("could not flush all output to Redis before exit")
        elif suspects:
            try:  # now, not when another worker's reaper comes by: requeued (attempt counted) or dead
                requeued, dead, *_ = self.q.reap()
                log.warning("gave up %d jobs: %d requeued, %d dead-lettered", len(suspects), requeued, dead)
            except Exception:  # noqa: BLE001 - any worker's reaper does it later
                log.exception("could not reap the jobs given up; another worker's reaper will")
        self.stop_event.set()
        self.fetcher.join(timeout=self.settings.idle_block_s + 2)
        self.control.join(timeout=2)
        self.publisher.join(timeout=2)
        self.control.stats.unregister()
        self.engine.close()
        log.info("worker %s stopped", self.worker_id)
