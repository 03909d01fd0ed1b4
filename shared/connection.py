"""One connection factory for every mlxq component: a single Redis or a Redis Cluster.

The URL of any node works.  Cluster mode is detected (``INFO cluster`` reports
``cluster_enabled:1``) unless the URL says so:

* ``redis+cluster://host:port`` / ``rediss+cluster://host:port``: a cluster, no probe;
* ``?cluster=yes`` / ``?cluster=no`` on any ``redis://`` / ``rediss://`` URL: forced either way;
* nothing: one ``INFO cluster`` round trip at connect decides.

On a cluster every model's keys share one hash slot (``{mlxq:<model>}``), so all
of a model's traffic can go to the master serving that slot over one plain
connection: :class:`SlotRedis` pins it there and re-resolves the slot's owner
after a ``MOVED`` reply or a lost link (a failover).  Plain connections keep
Lua scripts and pipelines working exactly as on a single Redis, which redis-py's
cluster pipeline does not (it refuses EVALSHA).
"""

from __future__ import annotations

import functools
import logging
import threading
from typing import Any, Optional
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import redis
from redis.cluster import RedisCluster
from redis.exceptions import ClusterDownError, MovedError, ReadOnlyError, TryAgainError

log = logging.getLogger(__name__)

# Errors after which a slot's owner must be looked up again (and the call retried by its caller).
RESLOT_ERRORS = (redis.ConnectionError, redis.TimeoutError, MovedError, ClusterDownError, TryAgainError,
                 ReadOnlyError)

_TRUE = {"1", "yes", "true", "on"}
_FALSE = {"0", "no", "false", "off"}
# A large pool: many concurrent result() waiters (BLPOP) or stream replays each hold a connection
# for a moment (pub/sub needs none of them: it is one connection per node, see producer/subscriber.py).
DEFAULT_KW = dict(health_check_interval=30, socket_keepalive=True, max_connections=10_000)


def split_url(url: str) -> tuple[str, Optional[bool]]:
    """The URL redis-py understands and the cluster mode it states (None: not stated)."""
    if not url:
        raise ValueError("no Redis URL: pass redis_url= or set MLXQ_REDIS_URL")
    parts = urlsplit(url)
    scheme, forced = parts.scheme, None
    if scheme.endswith("+cluster"):
        scheme, forced = scheme[: -len("+cluster")], True
    query = []
    for k, v in parse_qsl(parts.query, keep_blank_values=True):
        if k == "cluster":
            if v.lower() in _TRUE:
                forced = True
            elif v.lower() in _FALSE:
                forced = False
            else:
                raise ValueError(f"cluster= in the Redis URL must be yes or no, not {v!r}")
        else:
            query.append((k, v))
    return urlunsplit((scheme, parts.netloc, parts.path, urlencode(query), parts.fragment)), forced


@functools.lru_cache(maxsize=64)
def is_cluster_url(url: str) -> bool:
    """Whether the server at ``url`` runs in cluster mode (stated in the URL, else one INFO probe)."""
    plain, forced = split_url(url)
    if forced is not None:
        return forced
    if plain.startswith("unix://"):
        return False
    probe = redis.Redis.from_url(plain, socket_timeout=5, socket_connect_timeout=5, retry=None)
    try:
        return bool(int(probe.info("cluster").get("cluster_enabled", 0)))
    finally:
        probe.close()


def _cluster_mode(url: str) -> bool:
    """Cluster mode for ``url``; an unreachable server is taken as a single Redis (not cached:
    the next connect probes again; put ``cluster=yes`` in the URL to be sure)."""
    try:
        return is_cluster_url(url)
    except (redis.ConnectionError, redis.TimeoutError, OSError, redis.exceptions.NoPermissionError) as exc:
        # (an ACL user without INFO, e.g. the producer recipe: put cluster=yes in its URL on a cluster)
        log.info("could not probe %s for cluster mode (%s): taking it as a single Redis", _redact(url), exc)
        return False


def _redact(url: str) -> str:
    parts = urlsplit(url)
    if parts.password:
        return url.replace(f":{parts.password}@", ":***@", 1)
    return url


def connect(url: Optional[str], **kw: Any) -> redis.Redis | RedisCluster:
    """A sync client: ``redis.Redis`` for one server, ``RedisCluster`` for a cluster."""
    plain, _ = split_url(url or "")
    opts = {**DEFAULT_KW, **kw}
    if _cluster_mode(url):
        opts.pop("max_connections", None)
        return RedisCluster.from_url(plain, **opts)
    return redis.Redis.from_url(plain, **opts)


def connect_async(url: Optional[str], **kw: Any):
    """An asyncio client (``redis.asyncio.Redis`` or ``redis.asyncio.cluster.RedisCluster``).
    Cluster detection, when the URL does not state it, is one blocking round trip here."""
    import redis.asyncio as aredis
    from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster

    plain, _ = split_url(url or "")
    opts = {**DEFAULT_KW, **kw}
    if _cluster_mode(url):
        opts.pop("max_connections", None)
        opts.pop("health_check_interval", None)
        return AsyncRedisCluster.from_url(plain, **opts)
    return aredis.Redis.from_url(plain, **opts)


def is_cluster(client: Any) -> bool:
    from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster

    return isinstance(client, (RedisCluster, AsyncRedisCluster, SlotRedis))


def for_slot(client: Any, key: str) -> Any:
    """The client to use for the keys that share ``key``'s hash slot: the client itself on a
    single Redis, a :class:`SlotRedis` pinned to the slot's master on a cluster."""
    if isinstance(client, RedisCluster):
        return SlotRedis(client, key)
    return client


def _not_sent(exc: Exception) -> bool:
    """True when the failed command certainly did not run (safe to send again)."""
    if isinstance(exc, (MovedError, ClusterDownError, TryAgainError)):
        return True
    return isinstance(exc, redis.ConnectionError) and "connecting to" in str(exc)


class SlotRedis:
    """A plain ``redis.Redis`` on the master that serves one hash slot of a cluster.

    Attribute access goes to that node's client.  A call that fails with a
    ``MOVED``, a lost link or a cluster-down error marks the pin stale and
    re-raises; the next call asks the cluster who serves the slot now (after a
    failover: the promoted replica).  Pipelines do the same on ``execute``.
    """

    cluster_mode = True

    def __init__(self, cluster: RedisCluster, key: str):
        self.cluster = cluster
        self.key = key
        self.slot = cluster.keyslot(key)
        self._lock = threading.Lock()
        self._node_client: Optional[redis.Redis] = None

    def __repr__(self) -> str:
        return f"SlotRedis(slot={self.slot})"

    def current(self) -> redis.Redis:
        with self._lock:
            if self._node_client is None:
                node = self.cluster.nodes_manager.get_node_from_slot(self.slot)
                self._node_client = self.cluster.get_redis_connection(node)
            return self._node_client

    def invalidate(self) -> None:
        """Forget the pinned node and refresh the cluster's view of slot owners."""
        with self._lock:
            self._node_client = None
            try:
                self.cluster.nodes_manager.initialize()
            except Exception as exc:  # every known node unreachable: the next call retries
                log.warning("cluster topology refresh failed: %s", exc)

    def _guard(self, name: str, fn):
        @functools.wraps(fn)
        def call(*a, **kw):
            try:
                return fn(*a, **kw)
            except RESLOT_ERRORS as exc:
                self.invalidate()
                if not _not_sent(exc):
                    raise
            # the command never ran (MOVED, or the old master refused the connection): once more,
            # on the slot's master now
            return getattr(self.current(), name)(*a, **kw)
        return call

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.current(), name)
        return self._guard(name, attr) if callable(attr) else attr

    def pipeline(self, transaction: bool = True, shard_hint=None):
        """The node's own pipeline (scripts can be queued in it); ``execute`` re-resolves the slot on
        a lost link, and raises a ``MOVED`` found among the replies so the caller resends the batch."""
        pipe = self.current().pipeline(transaction=transaction, shard_hint=shard_hint)
        raw_execute = pipe.execute

        def execute(raise_on_error: bool = True):
            try:
                replies = raw_execute(raise_on_error=raise_on_error)
            except RESLOT_ERRORS:
                self.invalidate()
                raise
            for r in replies:
                if isinstance(r, (MovedError, ClusterDownError, TryAgainError, ReadOnlyError)):
                    self.invalidate()
                    raise r
            return replies

        pipe.execute = execute
        return pipe

    def register_script(self, script: str):
        return self.cluster.register_script(script)  # a Script object; it runs on whichever client it is given

