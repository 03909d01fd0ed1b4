"""The worker: one process, one model, one thread for every MLX call.

A job's path: the **fetcher** (``fetcher.py``) pulls it and prepares it (validates and
tokenizes it, resumes it from what earlier attempts published) into the ready queue; the **MLX
loop** (``mlx_loop.py``) admits it into the engine and steps it; the **host** (``host.py``)
turns each step's tokens into text, deltas and at last its result, which the publisher thread
(``publisher.py``) writes to Redis; **control** (``control.py``) renews its lease meanwhile,
and brings cancels and lost leases to the MLX loop's inbox (``inbox.py``).

``Worker`` wires the rooms together, and ``run`` is the MLX thread's loop: each pass takes
what the other rooms sent, admits ready jobs, runs one engine step.  Redis I/O runs on the
other threads and the host's work on its own, so that neither stalls a decode step.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import socket
import threading
import time
from typing import Optional

from ..shared.keys import GlobalKeys
from ..shared.protocol import Queue
from ..shared.settings import Settings
from . import blas
from .control import Control
from .engine.engine import make_engine
from .fetcher import Fetcher, Preparer, ReadyQueue, ServerClock
from .host import Host
from .hostwork import HostWork
from .inbox import Inbox
from .jobs import ActiveJob
from .mlx_loop import MLXLoop
from .model import LoadedModel
from .publisher import Publisher
from .series import SeriesPoints
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
        s = self.settings = settings or Settings.from_env()
        self.loaded = loaded
        self.worker_id = worker_id or new_worker_id()
        gk = GlobalKeys(s.prefix)
        self.keys = gk.model_keys(loaded.name)
        self.q = Queue(redis_client, self.keys, s)
        if engine is None:
            engine = make_engine(loaded, s if max_batch is None else dataclasses.replace(s, max_batch=max_batch))
        self.engine = engine
        self.grace_s = s.grace_s if grace_s is None else grace_s
        self.stop_event = threading.Event()  # threads exit
        self.draining = threading.Event()  # warm shutdown: finish or requeue, pull nothing
        self._sigterms = 0

        self.series = SeriesPoints(s.series_interval_s)  # the dashboard's plots (written by control)
        watched = Observers([*(observers or ()), self.series])
        self.stats = WorkerStats(self.worker_id, loaded.name, type(engine).__name__, s.stats_interval_s, watched)
        # no step completing for stall_s while jobs run: renew nothing more, exit (control.Heartbeat)
        self.watchdog = Watchdog(s.stall_s)
        self.inbox = Inbox()
        self.publisher = Publisher(self.q, self.stop_event, self.inbox)
        ready, active = ReadyQueue(), {}
        # the host thread: what becomes of each step's tokens, in step order (inline: MLXQ_HOST_THREAD=0)
        hostwork = HostWork(inline=not s.host_thread)
        self.host = Host(active, ready, engine, self.publisher, self.stats, watched, loaded.eos_token_ids,
                         hostwork.inline)
        kick = threading.Event()  # the MLX loop freed slots: the fetcher pulls at once
        self.loop = MLXLoop(engine, loaded.eos_token_ids, ready, active, self.host, hostwork, self.inbox,
                            self.stats, self.watchdog, self.draining, kick, self.publisher)
        clock = ServerClock()
        prepare = Preparer(self.q, loaded, s, engine, self.worker_id, ready, self.publisher, self.stats,
                           self.stop_event, clock)
        self.fetcher = Fetcher(self.q, self.worker_id, self.loop, prepare, self.stop_event, s.gather_ms / 1000.0,
                               s.idle_block_s, clock, kick)
        self.control = Control.build(self.q, self.worker_id, [self.fetcher, self.loop], self.inbox, self.stats,
                                     model_info={**loaded.info(), "max_new_tokens": s.max_new_tokens},
                                     registry_key=gk.models, stop=self.stop_event, global_redis=redis_client,
                                     watchdog=self.watchdog, series=self.series)

    # the jobs it holds (by engine uid), the jobs prepared for it, and what it counted
    @property
    def active(self) -> dict[str, ActiveJob]:
        return self.loop.active

    @property
    def ready(self) -> ReadyQueue:
        return self.loop.ready

    @property
    def processed(self) -> dict[str, int]:
        return self.stats.processed

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
        loop = self.loop
        idle_since: Optional[float] = None
        failure: Optional[str] = None
        try:
            while True:
                loop.hostwork.check()
                self._check_threads()
                loop.take_messages()
                loop.admit()
                if self.draining.is_set() and (not loop.active or time.monotonic() > self._drain_deadline):
                    break
                if not loop.has_work():
                    loop.idle()
                    if burst and not len(loop.ready) and self._queue_empty():
                        idle_since = idle_since or time.monotonic()
                        if time.monotonic() - idle_since > 0.3:
                            break
                    else:
                        idle_since = None
                    loop.wait_ready(0.02)
                    continue
                idle_since = None
                loop.step()
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
        """The I/O threads catch what they can; one that died anyway (a bug) leaves a worker that looks
        alive and serves nothing (no pulls, no output, leases lapsing), so the worker stops with it,
        as when the engine fails, and a supervisor starts a fresh one."""
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
            self.loop.hostwork.drain()  # every step's tokens published before the leftovers are requeued
        except Exception:
            log.exception("the host thread failed; requeueing what is left")
        self.loop.hostwork.close()
        out = self.loop.give_back(failure)
        self.publisher.publish(out)
        self.loop.refresh_stats(force=True)
        if not self.publisher.drain(timeout=30.0):
            log.error("could not flush all output to Redis before exit")
        elif out.abandons:
            try:  # now, not when another worker's reaper comes by: requeued (attempt counted) or dead
                requeued, dead, *_ = self.q.reap()
                log.warning("gave up %d jobs: %d requeued, %d dead-lettered", len(out.abandons), requeued, dead)
            except Exception:  # noqa: BLE001 - any worker's reaper does it later
                log.exception("could not reap the jobs given up; another worker's reaper will")
        self.stop_event.set()
        self.fetcher.join(timeout=self.settings.idle_block_s + 2)
        self.control.join(timeout=2)
        self.publisher.join(timeout=2)
        self.control.reporter.unregister()
        self.engine.close()
        log.info("worker %s stopped", self.worker_id)
