"""The fetcher thread: pulls as many jobs as there are free slots and prepares them (decode,
validate, tokenize) off the MLX thread; when idle it blocks on the queue's wake-up list, then waits a
short window to gather a batch.  Prepared jobs wait in the ``ReadyQueue`` for the MLX thread."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any, Callable, Optional

from ..shared.protocol import Queue, owner_token
from .redis_io import REDIS_ERRORS, Backoff

log = logging.getLogger(__name__)


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
