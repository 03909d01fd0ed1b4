"""A worker's points of the dashboard's rolling series (shared/series.py): what it counts as jobs run
(an observer: ``on_token`` and ``on_finish`` on the host thread, a few appends under a lock, never on
the decode step's path), and the point the control thread writes every ``series_interval_s``."""

from __future__ import annotations

import threading
import time

from ..shared import series
from ..shared.settings import TIERS


class SeriesPoints:
    def __init__(self, interval_s: float):
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._since = time.monotonic()
        self._next = 0.0  # monotonic time of the next point: the first at the first publish
        self._tokens = 0
        self._ends = {"done": 0, "failed": 0}
        self._ttfts: list[float] = []
        self._waits: list[float] = []

    def on_token(self, job, n: int, now: float) -> None:
        with self._lock:
            self._tokens += n

    def on_finish(self, job, result) -> None:
        st = result.stats
        with self._lock:
            self._ends["failed" if result.finish_reason == "error" else "done"] += 1
            if st.ttft_s is not None:
                self._ttfts.append(st.ttft_s)
            if st.queue_wait_s is not None:
                self._waits.append(st.queue_wait_s)

    def due(self) -> bool:
        return time.monotonic() >= self._next

    def take(self, queued: dict) -> dict:
        """The point of the interval since the last one (its counts start again)."""
        now = time.monotonic()
        with self._lock:
            p = series.point(now - self._since, self._tokens, self._ends["done"], self._ends["failed"], queued,
                             self._ttfts, self._waits)
            self._since, self._next = now, now + self.interval_s
            self._tokens, self._ends, self._ttfts, self._waits = 0, {"done": 0, "failed": 0}, [], []
        return p

    def write(self, redis, keys, worker_id: str) -> None:
        """Control thread: append this interval's point, with the queue depth by tier it reads now."""
        counts = redis.hmget(keys.counts, [f"queued:{t}" for t in TIERS])
        queued = {t: int(c) if c is not None else 0 for t, c in zip(TIERS, counts)}
        pipe = redis.pipeline(transaction=False)
        series.append(pipe, keys.series, worker_id, self.take(queued), time.time())
        pipe.execute()
