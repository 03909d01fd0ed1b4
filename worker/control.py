"""The control room: one thread that keeps the worker known to Redis and Redis's view of it right.

* ``Heartbeat`` vouches for the worker and renews its leases; the leases it lost and the jobs
  cancelled meanwhile go to the MLX loop's inbox.  A stuck engine (``worker.watchdog``) stops it.
* ``Reaper`` requeues jobs whose leases expired and the jobs of workers whose heartbeat is overdue.
* ``CancelListener`` takes cancels off the model's cancel channel.
* ``StatsPublisher`` publishes the worker's stats and its model's registry entry, and keeps the
  model's copy of the key registry and tier policy current.

``Control`` runs them in turn; the heartbeat first and on its own, so that no failure of the rest
keeps the leases from being renewed.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Callable

import redis

from ..shared import apikeys, codec
from ..shared.keys import GlobalKeys
from ..shared.protocol import Queue, load_functions
from ..shared.schemas import JOB_ID
from .inbox import Inbox
from ..shared.linkwatch import Backoff
from .redis_io import REDIS_ERRORS

log = logging.getLogger(__name__)

STALL_EXIT_CODE = 70  # (EX_SOFTWARE) the watchdog found the engine stuck: a supervisor restarts the worker


class Heartbeat:
    def __init__(self, q: Queue, worker_id: str, holders: list, inbox: Inbox, watchdog=None,
                 exit: Callable[[int], None] = os._exit):
        self.q = q
        self.worker_id = worker_id
        # the rooms that hold leases (the fetcher while it prepares a pull, the MLX loop), each with
        # leases(): job id -> owner token
        self.holders = holders
        self.inbox = inbox
        self.watchdog = watchdog
        self.exit = exit  # (a test that runs the worker in its own process replaces it)
        self.stalled = False

    def renew(self) -> None:
        """Renew this worker's leases; tell the MLX loop of those it lost (job id and the owner token
        that lost it) and of cancelled jobs."""
        leases = {job_id: owner for holder in self.holders for job_id, owner in holder.leases().items()}
        lost, cancel, late = self.q.heartbeat(self.worker_id, leases)
        if late:
            # (a stalled process, a paused VM, a lost link): another worker's reaper may have taken
            # this worker's jobs meanwhile; those come back as lost leases here and are dropped, and
            # the worker serves on
            log.warning("heartbeat %.1fs late: other workers may have taken over this worker's jobs", late)
        if lost:
            log.warning("leases lost for %d jobs: %s", len(lost), lost[:5])
            self.inbox.lost([(job_id, leases[job_id]) for job_id in lost if job_id in leases])
        if cancel:
            self.inbox.cancel(cancel)

    def healthy(self) -> bool:
        """False once the watchdog found the engine stuck; the first time, the worker exits (``stall``)."""
        if self.watchdog is None or self.watchdog.check():
            return True
        if not self.stalled:
            self.stalled = True
            try:
                self.stall()
            except Exception:
                log.exception("handling the stuck engine failed; no lease is renewed from now on")
        return False

    def stall(self) -> None:
        """The MLX thread cannot be stopped from here, and what it holds cannot be trusted: the process
        exits, with no warm shutdown. Its beat is withdrawn first, so that other workers take its jobs
        over at their next reap (not a takeover_s later); anything it still sends after that is fenced out."""
        log.error("worker %s is stuck: %s; it renews nothing more and exits (%d) for its supervisor to restart "
                  "it, and other workers take its jobs over", self.worker_id, self.watchdog.reason, STALL_EXIT_CODE)
        try:
            self.q.redis.zadd(self.q.keys.beats, {self.worker_id: 0})
        except Exception:  # noqa: BLE001 - its beat then runs out by itself
            log.warning("could not withdraw the heartbeat; other workers take the jobs over when it runs out")
        for handler in logging.getLogger().handlers:
            handler.flush()
        self.exit(STALL_EXIT_CODE)


class Reaper:
    def __init__(self, q: Queue):
        self.q = q
        self.reaped = [0, 0, 0]  # requeued, dead-lettered, cancelled

    def reap(self) -> None:
        requeued, dead, cancelled, taken = self.q.reap()
        if requeued or dead or cancelled:
            log.warning("reaped %d jobs (%d of a worker whose heartbeat was overdue, the rest of expired leases): "
                        "%d requeued, %d dead-lettered, %d cancelled", requeued + dead + cancelled, taken,
                        requeued, dead, cancelled)
            self.reaped = [a + b for a, b in zip(self.reaped, (requeued, dead, cancelled))]


class CancelListener:
    def __init__(self, q: Queue, inbox: Inbox):
        self.q = q
        self.inbox = inbox
        self._pubsub = None

    def listen(self, timeout: float) -> None:
        """Wait up to ``timeout`` for one message on the cancel channel (subscribed on first use)."""
        if self._pubsub is None:
            pubsub = self.q.redis.pubsub(ignore_subscribe_messages=True)
            if self.q.cluster:
                pubsub.ssubscribe(self.q.keys.cancel_channel)
            else:
                pubsub.subscribe(self.q.keys.cancel_channel)
            self._pubsub = pubsub
        msg = self._pubsub.get_message(timeout=timeout)
        if msg and msg.get("type") in ("message", "smessage"):
            self.on_message(msg["data"])

    def on_message(self, data) -> None:
        """A job id on the cancel channel: a producer without queue access flagged a queued job (a
        worker takes it out) or a running one (its worker ends it). Anyone who may publish there can
        send anything: what is not a job id, or fails as one (a record that is not a job's), is logged
        and dropped here, so that it never holds up the rest of the control loop."""
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
        self.inbox.cancel([job_id])

    def close(self) -> None:
        """Drop the subscription (a lost link: the next ``listen`` subscribes again)."""
        pubsub, self._pubsub = self._pubsub, None
        try:
            if pubsub is not None:
                pubsub.close()
        except Exception:
            pass


class StatsPublisher:
    def __init__(self, q: Queue, worker_id: str, stats, model_info: dict, registry_key: str, global_redis=None,
                 series=None):
        self.q = q
        self.series = series  # (worker.series) the dashboard's rolling series: a point now and then
        self.worker_id = worker_id
        self.worker_stats = stats  # (worker.stats) its snapshot, and publish_soon
        self.model_info = model_info
        self.registry_key = registry_key
        self.global_redis = global_redis if global_redis is not None else q.redis  # keys of no model
        self._seeded = False
        self.prepared = False

    def prepare(self) -> None:
        """Load mlxq's Redis Functions (for ACL-restricted producers) and copy the key registry and
        tier policy into this model's slot, before anything is admitted."""
        try:
            load_functions(self.q.redis)
        except redis.ResponseError as exc:  # e.g. a managed Redis without FUNCTION: scripts still work
            log.warning("could not load mlxq's Redis Functions (%s): ACL-restricted producers cannot submit", exc)
        self.sync_policy()
        self.prepared = True

    def sync_policy(self) -> None:
        """Keep this model's slot copy of the key registry and tier policy current."""
        gk = GlobalKeys(self.q.keys.prefix)
        if not self._seeded:
            apikeys.seed_policy(self.global_redis, gk, self.q.settings.tier_offsets, self.q.settings.max_queued_per_tier)
            self._seeded = True
        if apikeys.sync_if_stale(self.global_redis, self.q.redis, gk, self.q.keys.model):
            log.info("copied the API-key registry and tier policy into model %s's slot", self.q.keys.model)

    def publish(self) -> None:
        self.sync_policy()
        s = self.q.settings
        k = self.q.keys
        snap = self.worker_stats.snapshot
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
        if self.series is not None and self.series.due():
            self.series.write(self.q.redis, k, self.worker_id)

    def unregister(self) -> None:
        try:
            self.q.redis.zrem(self.q.keys.workers, self.worker_id)
            self.q.redis.zrem(self.q.keys.beats, self.worker_id)  # (its jobs were given back)
            self.q.redis.delete(self.q.keys.worker(self.worker_id))
        except REDIS_ERRORS:
            pass


class Control(threading.Thread):
    """The control thread: heartbeat, queue admission, cancel listener, stats and reaper, in turn."""

    def __init__(self, heartbeat: Heartbeat, reaper: Reaper, cancels: CancelListener, reporter: StatsPublisher,
                 stop: threading.Event):
        super().__init__(name="mlxq-control", daemon=True)
        self.heartbeat = heartbeat
        self.reaper = reaper
        self.cancels = cancels
        self.reporter = reporter
        self.q = heartbeat.q
        self.stop_event = stop
        self.backoff = Backoff()

    @classmethod
    def build(cls, q: Queue, worker_id: str, holders: list, inbox: Inbox, stats, model_info: dict,
              registry_key: str, stop: threading.Event, global_redis=None, watchdog=None, series=None) -> "Control":
        return cls(Heartbeat(q, worker_id, holders, inbox, watchdog), Reaper(q), CancelListener(q, inbox),
                   StatsPublisher(q, worker_id, stats, model_info, registry_key, global_redis, series), stop)

    def run(self) -> None:
        s = self.q.settings
        next_beat = next_admit = next_stats = next_reap = 0.0
        publish_soon = self.reporter.worker_stats.publish_soon
        while not self.stop_event.is_set():
            now = time.monotonic()
            if self.heartbeat.healthy() and now >= next_beat:
                try:
                    self.heartbeat.renew()
                    next_beat = now + s.heartbeat_s
                except REDIS_ERRORS:
                    pass  # the loop below meets it too, reports it and backs off
                except Exception:
                    log.exception("renewing the leases failed")
            try:
                if not self.reporter.prepared:
                    self.reporter.prepare()
                self.cancels.listen(timeout=0.1)
                now = time.monotonic()
                if now >= next_admit:
                    self.q.admit()  # jobs from producers that may not write the queue, placed within a beat
                    next_admit = now + s.heartbeat_s
                if now >= next_stats or publish_soon.is_set():
                    publish_soon.clear()
                    self.reporter.publish()
                    next_stats = now + s.stats_interval_s
                if now >= next_reap:
                    self.reaper.reap()
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
                self.cancels.close()
                time.sleep(delay)
            except Exception:
                log.exception("control loop error")
                time.sleep(0.5)
        self.cancels.close()
