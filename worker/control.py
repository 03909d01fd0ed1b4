"""The control thread: the heartbeat (which vouches for the worker and renews its leases), reaping
of expired leases and of overdue workers' jobs, stats, the model registry, and the cancel channel."""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Optional

import redis

from ..shared import apikeys, codec
from ..shared.keys import GlobalKeys
from ..shared.protocol import Queue, load_functions
from ..shared.schemas import JOB_ID
from .redis_io import REDIS_ERRORS, Backoff

log = logging.getLogger(__name__)


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
