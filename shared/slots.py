"""A cluster client's traffic on one hash slot's master.

On a cluster every model's keys share one hash slot (``{mlxq:<model>}``), so all of a model's traffic
can go to the master serving that slot over one plain connection: :class:`SlotRedis` (threads) and
:class:`AsyncSlotRedis` (asyncio) pin it there and re-resolve the slot's owner after a ``MOVED`` reply
or a lost link (a failover).  Plain connections keep Lua scripts and pipelines working exactly as on
a single Redis, which redis-py's cluster pipeline does not (it refuses EVALSHA).  :func:`for_slot`
gives a client its pin (the client itself on a single Redis).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
from typing import Any, Optional

import redis
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.cluster import RedisCluster
from redis.exceptions import ClusterDownError, MovedError, ReadOnlyError, TryAgainError

from .linkwatch import RESLOT_ERRORS

log = logging.getLogger(__name__)


def refresh_topology(cluster: RedisCluster) -> None:
    """Ask who serves which slot now: the configured seeds plus every node discovered so far
    (raises when none answers; the caller retries)."""
    nm = cluster.nodes_manager
    seeds = getattr(cluster, "mlxq_seeds", None)  # connection.Seeds, kept by connect()
    if seeds is None:
        nm.initialize()
        return
    seeds.learn(list(nm.nodes_cache.values()))
    nm.initialize(additional_startup_nodes_info=seeds.missing_from(dict(nm.startup_nodes)))
    seeds.learn(list(nm.nodes_cache.values()))


async def refresh_topology_async(cluster) -> None:
    """``refresh_topology`` for the asyncio cluster client.  Only the slot map is re-read (the
    NodesManager) once the client is initialized: a failed ``RedisCluster.initialize`` closes every
    node's connections, also those other tasks are sending on.  A client that redis-py marked for
    re-initialization (after a failed command of its own) is initialized here, from the seeds too:
    mlxq's traffic goes over pinned plain clients (:class:`AsyncSlotRedis`) and pub/sub links of
    its own, which that does not disturb, and the pins and pub/sub links need the new slot map."""
    nm = cluster.nodes_manager
    seeds = getattr(cluster, "mlxq_seeds", None)
    if seeds is not None:
        seeds.learn(list(nm.nodes_cache.values()))
    extra = None if seeds is None else seeds.missing_from(dict(nm.startup_nodes)) or None
    if cluster._initialize:
        await cluster.initialize(additional_startup_nodes_info=extra)
    else:
        await nm.initialize(additional_startup_nodes_info=extra)
    if seeds is not None:
        seeds.learn(list(cluster.nodes_manager.nodes_cache.values()))


def is_cluster(client: Any) -> bool:
    return isinstance(client, (RedisCluster, AsyncRedisCluster, SlotRedis, AsyncSlotRedis))


def for_slot(client: Any, key: str, pins: Optional[dict] = None) -> Any:
    """The client to use for the keys that share ``key``'s hash slot: the client itself on a
    single Redis; on a cluster, a client pinned to the slot's master: a :class:`SlotRedis` for a sync
    client, an :class:`AsyncSlotRedis` for an asyncio one, one per slot, kept in the cluster client
    (``mlxq_pins``) or else in ``pins``, so that every task (and every ``AsyncClient`` sharing the
    cluster client, as the gateway's do) shares it."""
    if isinstance(client, RedisCluster):
        return SlotRedis(client, key)
    if not isinstance(client, AsyncRedisCluster):
        return client
    pins = getattr(client, "mlxq_pins", pins)
    slot = client.keyslot(key)
    if pins is None:
        return AsyncSlotRedis(client, slot)
    pin = pins.get(slot)
    if pin is None:
        pin = pins[slot] = AsyncSlotRedis(client, slot)
    return pin


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
            refresh_topology(self.cluster)
        except Exception as exc:  # every known node unreachable: the next call retries
            log.debug("cluster topology refresh failed: %s", exc)

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



def node_client_async(cluster, node):
    """A plain asyncio client on one cluster node, with the cluster's credentials and TLS.  It does
    not retry on its own: redis-py's default (3 reconnects, exponential backoff from 1 s) kept a
    call on a killed master failing for several seconds before its caller learned of it; mlxq's
    callers retry through :class:`LinkWatch`, re-resolving the slot's owner first."""
    import redis.asyncio as aredis
    from redis.asyncio.retry import Retry as AsyncRetry
    from redis.backoff import NoBackoff

    kw = {k: v for k, v in node.connection_kwargs.items()
          if k in ("username", "password", "socket_timeout", "socket_connect_timeout", "socket_keepalive",
                   "ssl_keyfile", "ssl_certfile", "ssl_cert_reqs", "ssl_ca_certs", "ssl_check_hostname")}
    ssl = "SSL" in getattr(node.connection_class, "__name__", "")
    return aredis.Redis(host=node.host, port=node.port, ssl=ssl, retry=AsyncRetry(NoBackoff(), 0), **kw)


class AsyncSlotRedis:
    """:class:`SlotRedis` for asyncio: a plain ``redis.asyncio.Redis`` on the master serving one slot.

    redis-py's asyncio cluster client recovers from a failover one command at a time: every
    command that meets the dead master marks the whole client for re-initialization, the next
    one re-reads the topology (and the COMMAND table) under one lock, a failed or CLUSTERDOWN
    attempt closes every node's connections, also those other tasks are waiting on, and those
    tasks start over behind the lock.  With many jobs waiting (BLPOP, XRANGE) they come back
    one by one, seconds apart.  Here the slot's owner is looked up once per failure, however
    many tasks notice it: the first task to see the pinned client fail re-reads the topology
    under an asyncio lock and the others just take the new pin (the caller's retry loop, with
    backoff, sends the command again).  Plain connections also keep scripts working as on a
    single Redis.
    """

    cluster_mode = True

    def __init__(self, cluster, slot: int):
        self.cluster = cluster
        self.slot = slot
        self._lock: Optional[asyncio.Lock] = None
        self._client = None

    def __repr__(self) -> str:
        return f"AsyncSlotRedis(slot={self.slot})"

    def _locked(self) -> asyncio.Lock:
        if self._lock is None:
            self._lock = asyncio.Lock()
        return self._lock

    async def current(self):
        client = self._client
        if client is not None:
            return client
        async with self._locked():
            if self._client is None:
                if self.cluster._initialize:  # a first use, or the cluster client gave up its map
                    await refresh_topology_async(self.cluster)
                node = self.cluster.nodes_manager.get_node_from_slot(self.slot)
                self._client = node_client_async(self.cluster, node)
                log.debug("slot %d pinned to %s", self.slot, node.name)
            return self._client

    async def invalidate(self, stale) -> None:
        """``stale`` failed: forget it and re-read the topology, unless another task already did."""
        async with self._locked():
            if self._client is not stale:
                return
            log.debug("slot %d: pinned node failed; re-reading the topology", self.slot)
            self._client = None
            try:
                await refresh_topology_async(self.cluster)
            except Exception as exc:  # every known node unreachable: the caller's retry comes back here
                log.debug("cluster topology refresh failed: %s", exc)
        await _close_quietly(stale)  # its other users fail at once and retry on the new pin

    def __getattr__(self, name: str) -> Any:
        async def call(*a, **kw):
            client = await self.current()
            try:
                return await getattr(client, name)(*a, **kw)
            except RESLOT_ERRORS as exc:
                await self.invalidate(client)
                if not _not_sent(exc):
                    raise
            # the command never ran (MOVED, or the old master refused the connection): once more
            return await getattr(await self.current(), name)(*a, **kw)
        call.__name__ = name
        return call

    async def aclose(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await _close_quietly(client)


@contextlib.contextmanager
def one_connection(client):
    """One connection of ``client``'s pool for the block: ``WAIT`` counts the writes sent on its own
    connection, so a write and its ``WAIT`` must share one.  On a cluster the pin's node (a failover's
    error marks the pin stale, as any of its calls does)."""
    node = client.current() if isinstance(client, SlotRedis) else client
    conn = node.client()
    try:
        yield conn
    except RESLOT_ERRORS:
        if isinstance(client, SlotRedis):
            client.invalidate()
        raise
    finally:
        conn.close()


@contextlib.asynccontextmanager
async def one_connection_async(client):
    """``one_connection`` for an asyncio client (an :class:`AsyncSlotRedis` pin on a cluster)."""
    node = await client.current() if isinstance(client, AsyncSlotRedis) else client
    conn = node.client()
    try:
        yield conn
    except RESLOT_ERRORS:
        if isinstance(client, AsyncSlotRedis):
            await client.invalidate(node)
        raise
    finally:
        await conn.aclose()


async def _close_quietly(client) -> None:
    try:
        await client.aclose()
    except Exception as exc:
        log.debug("closing a pinned client: %s", exc)


async def close_pins(client) -> None:
    """Close the pinned per-slot clients of an asyncio cluster client (before closing it)."""
    pins = getattr(client, "mlxq_pins", None) or {}
    for pin in list(pins.values()):
        await pin.aclose()
    pins.clear()
