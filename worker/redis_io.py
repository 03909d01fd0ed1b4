"""Redis errors a worker's I/O threads retry through, and the backoff they retry with.

The threads themselves live in rooms of their own: ``fetcher`` (pull, prepare), ``publisher``
(a step's writes) and ``control`` (heartbeat, reaper, cancel listener, stats).
"""

from __future__ import annotations

import redis
from redis.backoff import FullJitterBackoff

from ..shared.connection import RESLOT_ERRORS

# A lost link, a restarting Redis, or a cluster failover (MOVED, CLUSTERDOWN, READONLY): retry with backoff.
REDIS_ERRORS = (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError, OSError) + RESLOT_ERRORS


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
