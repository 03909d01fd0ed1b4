"""Redis errors a worker's I/O threads retry through (with ``shared.linkwatch.Backoff``).

The threads themselves live in rooms of their own: ``fetcher`` (pull, prepare), ``publisher``
(a step's writes) and ``control`` (heartbeat, reaper, cancel listener, stats).
"""

from __future__ import annotations

import redis

from ..shared.linkwatch import RESLOT_ERRORS

# A lost link, a restarting Redis, or a cluster failover (MOVED, CLUSTERDOWN, READONLY): retry with backoff.
REDIS_ERRORS = (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError, OSError) + RESLOT_ERRORS

