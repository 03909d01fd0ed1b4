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
(:func:`.slots.refresh_topology`) asks the seeds plus every node discovered so far, so losing any one
node, the one in the URL included, never leaves it without a node to ask.

Once connected, a cluster client's traffic goes through the pins of :mod:`.slots` (one plain
connection to the master serving a model's hash slot).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Optional
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import redis
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import ClusterDownError

# LINK_ERRORS and RedisUnreachable: what every caller of connect() catches, importable from here
from .linkwatch import LINK_ERRORS, LinkWatch, RedisUnreachable  # noqa: F401
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
        self.mlxq_pins: dict = {}  # slot -> its slots.AsyncSlotRedis, shared by every task and client
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


def replica_acked(acked: Any, job_id: str, wait_ms: int) -> None:
    """After ``WAIT 1 wait_ms``: a warning when no replica had the job in time (it is queued all the
    same; lost in a failover, its producer submits it again)."""
    if int(acked or 0) < 1:
        log.warning("job %s: no replica acknowledged its submit within %d ms (submit_replica_ack_ms); a failover "
                    "now could lose it (its producer would submit it again)", job_id, wait_ms)
