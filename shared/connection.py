"""One connection factory for every mlxq component: a single Redis or a Redis Cluster.

The URL of any node works, and a cluster URL may name several seed nodes, separated by commas
(the form Lettuce, Jedis URIs and most cluster clients accept)::

    redis://h1:7000,h2:7001,h3:7002/0?cluster=yes

Cluster mode is detected (``INFO cluster`` reports ``cluster_enabled:1``) unless the URL says so:

* ``redis+cluster://host:port`` / ``rediss+cluster://host:port``: a cluster, no probe;
* ``?cluster=yes`` / ``?cluster=no`` on any ``redis://`` / ``rediss://`` URL: forced either way;
* nothing: ``INFO cluster`` on the first seed that answers decides.  A seed that does not answer
  decides nothing: the next one is asked, in rounds with backoff, and when none has answered
  within ``wait_s`` the connect fails with one line naming them (never a guess).

A cluster client keeps its configured seeds for good: every topology refresh mlxq asks for
(:func:`refresh_topology`) asks the seeds plus every node discovered so far, so losing any one
node, the one in the URL included, never leaves it without a node to ask.

On a cluster every model's keys share one hash slot (``{mlxq:<model>}``), so all
of a model's traffic can go to the master serving that slot over one plain
connection: :class:`SlotRedis` pins it there and re-resolves the slot's owner
after a ``MOVED`` reply or a lost link (a failover).  Plain connections keep
Lua scripts and pipelines working exactly as on a single Redis, which redis-py's
cluster pipeline does not (it refuses EVALSHA).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
import time
from typing import Any, Callable, Optional
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import redis
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import ClusterDownError, MovedError, ReadOnlyError, TryAgainError

# LINK_ERRORS and RedisUnreachable: what every caller of connect() catches, importable from here
from .linkwatch import LINK_ERRORS, RESLOT_ERRORS, LinkWatch, RedisUnreachable  # noqa: F401
from .settings import Settings

log = logging.getLogger(__name__)

_TRUE = {"1", "yes", "true", "on"}
_FALSE = {"0", "no", "false", "off"}
# A large pool: many concurrent result() waiters (BLPOP) or stream replays each hold a connection
# for a moment (pub/sub needs none of them: it is one connection per node, see producer/subscriber.py).
# Socket timeouts: no call blocks for ever on a dead peer (the longest blocking command mlxq sends,
# BLPOP, waits at most a few seconds).
DEFAULT_KW = dict(health_check_interval=30, socket_keepalive=True, max_connections=10_000,
                  socket_connect_timeout=5, socket_timeout=20)


def _outage_s() -> float:
    """How long a caller that passed no ``wait_s`` waits: its ``Settings.redis_outage_s``, read from the
    environment as a ``Client`` with no settings reads it (callers that hold settings pass theirs)."""
    return Settings.from_env().redis_outage_s


def parse_url(url: str) -> tuple[str, list[tuple[str, int]], Optional[bool]]:
    """(the first seed's URL as redis-py reads it, every seed as (host, port), the cluster mode stated)."""
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
    userinfo, at, hostlist = parts.netloc.rpartition("@")
    if scheme == "unix":
        q = urlencode(query)
        return f"unix://{parts.netloc}{parts.path}" + (f"?{q}" if q else ""), [], forced
    hosts = [h.strip() for h in hostlist.split(",")]
    if not all(hosts):
        raise ValueError(f"an empty host in the Redis URL's seed list: {hostlist!r}")
    seeds = [_host_port(h) for h in hosts]
    first = urlunsplit((scheme, userinfo + at + hosts[0], parts.path, urlencode(query), parts.fragment))
    if len(hosts) > 1 and forced is False:
        raise ValueError("several hosts in a Redis URL are seeds of a Redis Cluster: drop cluster=no")
    return first, seeds, forced


def _host_port(netloc: str) -> tuple[str, int]:
    probe = urlsplit(f"//{netloc}")
    return probe.hostname or "localhost", probe.port or 6379


def _names(seeds) -> str:
    return ", ".join(f"{h}:{p}" for h, p in seeds)


def _is_link_failure(exc: BaseException) -> bool:
    """A failure to reach a node (the cause of a RedisClusterException included), not a refusal."""
    while exc is not None:
        if isinstance(exc, (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError, ConnectionError,
                            ClusterDownError)):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def until_answered(what: str, seeds, wait_s: Optional[float], attempt: Callable[[], Any]) -> Any:
    """``attempt()`` until it returns, retrying link failures with backoff for up to ``wait_s``;
    then :class:`RedisUnreachable` naming ``seeds``."""
    wait_s = _outage_s() if wait_s is None else wait_s
    watch = LinkWatch(what, lambda: _names(seeds))
    return watch.call(attempt, time.monotonic() + wait_s, is_link=_is_link_failure)


def _probe(first_url: str) -> bool:
    """``INFO cluster`` on one node, asked anew each time: a cached answer outlived the server that
    gave it (a port reused by another server, a node restarted in the other mode)."""
    probe = redis.Redis.from_url(first_url, socket_timeout=5, socket_connect_timeout=5, retry=None)
    try:
        return bool(int(probe.info("cluster").get("cluster_enabled", 0)))
    finally:
        probe.close()


def is_cluster_url(url: str, wait_s: Optional[float] = None) -> bool:
    """Whether ``url`` names a cluster: stated in the URL, else ``INFO cluster`` on the first seed
    that answers (each seed in turn, in rounds, for up to ``wait_s``; a dead seed decides nothing)."""
    first, seeds, forced = parse_url(url)
    if forced is not None:
        return forced
    if first.startswith("unix://"):
        return False
    urls = [_seed_url(first, h, p) for h, p in seeds]

    def any_seed() -> bool:
        last: Optional[BaseException] = None
        for u in urls:
            try:
                return _probe(u)
            except redis.exceptions.NoPermissionError:
                # an ACL user without INFO (the producer recipe): put cluster=yes in its URL on a cluster
                log.info("%s may not run INFO: taking it as a single Redis (put cluster=yes in the URL "
                         "on a cluster)", _redact(u))
                return False
            except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError, ConnectionError) as exc:
                last = exc
        raise redis.ConnectionError(str(last))

    mode = until_answered("cluster mode probe", seeds, wait_s, any_seed)
    if len(seeds) > 1 and not mode:
        raise ValueError(f"several hosts in the Redis URL ({_names(seeds)}) but {seeds[0][0]} is not a "
                         "cluster node: a single Redis takes one host")
    return mode


def _seed_url(first: str, host: str, port: int) -> str:
    parts = urlsplit(first)
    userinfo, at, _ = parts.netloc.rpartition("@")
    netloc = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return urlunsplit((parts.scheme, userinfo + at + netloc, parts.path, parts.query, parts.fragment))


def _redact(url: str) -> str:
    parts = urlsplit(url)
    if parts.password:
        return url.replace(f":{parts.password}@", ":***@", 1)
    return url


class Seeds:
    """A cluster client's configured seed nodes, kept for good, and every node discovered so far."""

    def __init__(self, seeds: list[tuple[str, int]]):
        self.configured = list(seeds)
        self._known = dict.fromkeys(seeds)
        self._lock = threading.Lock()

    def learn(self, nodes) -> None:
        with self._lock:
            for n in nodes:
                self._known.setdefault((n.host, int(n.port)))

    def all(self) -> list[tuple[str, int]]:
        with self._lock:
            return list(self._known)

    def missing_from(self, startup_nodes: dict) -> list[tuple[str, int]]:
        """The seeds and known nodes a refresh would not ask on its own (redis-py replaces its
        startup nodes with the nodes it discovered last, so a dead seed drops out of them)."""
        names = set(startup_nodes)
        return [hp for hp in self.all() if f"{hp[0]}:{hp[1]}" not in names]

    def names(self) -> str:
        return _names(self.all())


class SeededCluster(RedisCluster):
    """redis-py's sync cluster client, started from every seed, remembering them (``mlxq_seeds``)."""

    def __init__(self, *args, mlxq_seeds: Seeds, **kw):
        self.mlxq_seeds = mlxq_seeds
        super().__init__(*args, **kw)
        mlxq_seeds.learn(self.nodes_manager.nodes_cache.values())


class AsyncSeededCluster(AsyncRedisCluster):
    """redis-py's asyncio cluster client, started from every seed, remembering them."""

    __slots__ = ("mlxq_seeds", "mlxq_pins")

    def __init__(self, *args, mlxq_seeds: Seeds, **kw):
        self.mlxq_seeds = mlxq_seeds
        self.mlxq_pins: dict[int, AsyncSlotRedis] = {}  # one pin per slot, shared by every task and client
        super().__init__(*args, **kw)


def nodes_tried(client: Any) -> str:
    """The nodes a client asks, for error messages: a cluster's seeds and known nodes, else host:port."""
    seeds = getattr(getattr(client, "cluster", client), "mlxq_seeds", None)
    if seeds is not None:
        return seeds.names()
    try:
        kw = client.connection_pool.connection_kwargs
        return f"{kw.get('host', kw.get('path'))}:{kw.get('port', '')}".rstrip(":")
    except AttributeError:
        return repr(client)


def refresh_topology(cluster: RedisCluster) -> None:
    """Ask who serves which slot now: the configured seeds plus every node discovered so far
    (raises when none answers; the caller retries)."""
    nm = cluster.nodes_manager
    seeds: Optional[Seeds] = getattr(cluster, "mlxq_seeds", None)
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
    seeds: Optional[Seeds] = getattr(cluster, "mlxq_seeds", None)
    if seeds is not None:
        seeds.learn(list(nm.nodes_cache.values()))
    extra = None if seeds is None else seeds.missing_from(dict(nm.startup_nodes)) or None
    if cluster._initialize:
        await cluster.initialize(additional_startup_nodes_info=extra)
    else:
        await nm.initialize(additional_startup_nodes_info=extra)
    if seeds is not None:
        seeds.learn(list(cluster.nodes_manager.nodes_cache.values()))


def connect(url: Optional[str], *, wait_s: Optional[float] = None, **kw: Any) -> redis.Redis | RedisCluster:
    """A sync client: ``redis.Redis`` for one server, a ``RedisCluster`` (kept seeds) for a cluster."""
    first, seeds, _ = parse_url(url or "")
    opts = {**DEFAULT_KW, **kw}
    if not is_cluster_url(url, wait_s):
        return redis.Redis.from_url(first, **opts)
    opts.pop("max_connections", None)
    book = Seeds(seeds)
    others = [ClusterNode(h, p) for h, p in seeds[1:]]
    return until_answered("cluster connect", seeds, wait_s, lambda: SeededCluster.from_url(
        first, startup_nodes=list(others), mlxq_seeds=book, **opts))


def connect_async(url: Optional[str], *, wait_s: Optional[float] = None, **kw: Any):
    """An asyncio client (``redis.asyncio.Redis`` or an asyncio ``RedisCluster`` with kept seeds).
    Cluster detection, when the URL does not state it, is a blocking round trip here."""
    import redis.asyncio as aredis
    from redis.asyncio.cluster import ClusterNode as AsyncClusterNode

    first, seeds, _ = parse_url(url or "")
    opts = {**DEFAULT_KW, **kw}
    if not is_cluster_url(url, wait_s):
        return aredis.Redis.from_url(first, **opts)
    opts.pop("max_connections", None)
    opts.pop("health_check_interval", None)
    others = [AsyncClusterNode(h, p) for h, p in seeds[1:]]
    return AsyncSeededCluster.from_url(first, startup_nodes=others, mlxq_seeds=Seeds(seeds), **opts)


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


def replica_acked(acked: Any, job_id: str, wait_ms: int) -> None:
    """After ``WAIT 1 wait_ms``: a warning when no replica had the job in time (it is queued all the
    same; lost in a failover, its producer submits it again)."""
    if int(acked or 0) < 1:
        log.warning("job %s: no replica acknowledged its submit within %d ms (submit_replica_ack_ms); a failover "
                    "now could lose it (its producer would submit it again)", job_id, wait_ms)


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
