"""The MLX loop room: the one thread that calls MLX.

Each pass takes what the other rooms sent (``take_messages``: sequences the host ended, jobs past
their deadline, cancels and lost leases from the inbox), admits ready jobs into the engine
(``admit``), and runs one engine step (``step``), whose tokens go to the host thread at once.
Redis I/O never happens here, so it never stalls a decode step.
"""

from __future__ import annotations

import logging
import threading
import time
from functools import partial
from typing import Optional

import mlx.core as mx

from ..shared.schemas import MAX_N
from .fetcher import ReadyQueue
from .host import Host
from .hostwork import HostWork
from .inbox import Inbox
from .jobs import ActiveJob, admit_now, sample_uid
from .publisher import Publisher, StepOutput
from .stats import WorkerStats
from .watchdog import Watchdog

log = logging.getLogger(__name__)


class MLXLoop:
    def __init__(self, engine, eos_token_ids, ready: ReadyQueue, active: dict[str, ActiveJob], host: Host,
                 hostwork: HostWork, inbox: Inbox, stats: WorkerStats, watchdog: Watchdog,
                 draining: threading.Event, kick: threading.Event, publisher: Publisher):
        self.engine = engine
        self.eos_token_ids = eos_token_ids
        self.ready = ready
        self.active = active  # by engine uid; added here, ended by the host thread; others take copies
        self.host = host
        self.hostwork = hostwork
        self.inbox = inbox
        self.stats = stats
        self.watchdog = watchdog
        self.draining = draining
        self.kick = kick  # the fetcher's: slots freed up
        self.publisher = publisher  # (its round-trip count, for the stats: it is sent nothing from here)
        self._isolating = False  # a suspect job waits for the engine to drain, or runs alone (admit_now)
        self._engine_free = engine.free_slots()
        self._engine_urgent_below = float("-inf")

    # -- read by the other threads ---------------------------------------------
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

    # -- a pass -----------------------------------------------------------------
    def take_messages(self) -> None:
        """Drop what the host ended, expire jobs past their deadline, act on the inbox."""
        self._apply_removals()
        self._expire()
        self.handle_control()

    def has_work(self) -> bool:
        return self.engine.has_work()

    def admit(self) -> None:
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
            self.hostwork.put(partial(self.host.finish_done, done))
        if jobs:
            self.kick.set()

    def step(self) -> None:
        """One engine step; its tokens go to the host thread."""
        t0 = time.perf_counter()
        self.watchdog.step_started()
        events, preempted = self.engine.step()
        self._hand_over(events, preempted)
        self.watchdog.step_done()
        self.stats.busy_s += time.perf_counter() - t0
        self.refresh_stats()

    def idle(self) -> None:
        """No step to run (the watchdog times no stall meanwhile): the stats stay fresh."""
        self.watchdog.idle()
        self.refresh_stats()

    def wait_ready(self, timeout: float) -> None:
        self.ready.event.wait(timeout)

    def refresh_stats(self, force: bool = False) -> None:
        if force or self.stats.due_now():
            self.stats.refresh(self.active, len(self.ready), self.publisher.round_trips, self.draining.is_set(),
                               self.engine.stats())

    # -- the parts ----------------------------------------------------------------
    def _spec(self, job: ActiveJob):
        spec = job.spec(self.eos_token_ids)
        spec.want_logprobs = bool(job.request.logprobs)
        return spec

    def _hand_over(self, events, preempted) -> None:
        """Read what the step's tokens need from MLX (log-probabilities), then hand them to the host."""
        tops = [None] * len(events)
        for i, ev in enumerate(events):
            job = self.active.get(ev.uid)
            if job is not None and job.request.logprobs and ev.token is not None:
                tops[i] = _logprobs(ev, job.request.logprobs)
        self.stats.step(len(events))
        if events or preempted:
            self.hostwork.put(partial(self.host.after_step, events, preempted, tops))

    def _apply_removals(self) -> None:
        uids = self.host.take_removals()
        if uids:
            self.engine.remove(uids)

    def _expire(self) -> None:
        """Jobs past their ``timeout_s`` (running or waiting to be admitted) end, as a cancel does,
        with finish reason "timeout" and their tokens so far."""
        now = time.monotonic()
        with self.ready.lock:
            jobs = list(self.active.values()) + [j for j in self.ready.items if isinstance(j, ActiveJob)]
        late = [j for j in jobs if j.deadline is not None and not j.timed_out and now >= j.deadline]
        for job in late:
            job.timed_out = True
        if late:
            self.inbox.timeout(sorted({j.id for j in late}))

    def handle_control(self) -> None:
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
                self.hostwork.put(partial(self.host.end_by_control, kind, ended))

    def _samples(self, job_id: str) -> list[ActiveJob]:
        """The job's active sequences: the job itself (n == 1), or its samples still running."""
        job = self.active.get(job_id)
        if job is not None:
            return [job]
        return [s for i in range(MAX_N) if (s := self.active.get(sample_uid(job_id, i))) is not None]

    def _take_ready(self, job_id: str, owner: Optional[str] = None) -> list[ActiveJob]:
        with self.ready.lock:
            taken = [item for item in self.ready.items if item.id == job_id and owner in (None, item.owner)]
            for item in taken:
                self.ready.items.remove(item)
        return taken

    # -- at the end ---------------------------------------------------------------
    def give_back(self, failure: Optional[str]) -> StepOutput:
        """Take every job out of the engine and of the ready queue: they go back to the queue (requeued),
        or, after a ``failure``, the ones the engine held are given up with it (their attempt counts)."""
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
        if leftovers:
            self.engine.remove([s.uid for s in leftovers])
        for s in leftovers:
            self.active.pop(s.uid, None)
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
        return out


def _logprobs(ev, k: int) -> dict:
    lp = ev.logprobs
    if lp is None:
        return {"token": ev.token, "logprob": None, "top": []}
    lp = lp.reshape(-1)
    top = mx.argpartition(-lp, kth=k - 1)[:k]
    top_vals = lp[top]
    order = mx.argsort(-top_vals)
    ids, vals = top[order].tolist(), top_vals[order].tolist()
    return {"token": ev.token, "logprob": lp[ev.token].item(), "top": [[i, v] for i, v in zip(ids, vals)]}
