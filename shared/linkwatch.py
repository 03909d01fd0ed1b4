"""What a lost Redis link means to a caller, and how its calls retry through one.

One core decides (``LinkWatch.pause``): which errors are a lost link, how long to wait before the next
try (:class:`Backoff`), and when to give up (:class:`RedisUnreachable`).  Two thin transports only
do the I/O: ``call`` / ``backoff`` / ``refresh`` for threads (``time.sleep``, plain calls) and
``acall`` / ``abackoff`` / ``arefresh`` for asyncio (``asyncio.sleep``, awaited calls).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import threading
import time
from typing import Any, Callable, Optional

import redis
from redis.exceptions import ClusterDownError, MovedError, ReadOnlyError, RedisClusterException, TryAgainError

log = logging.getLogger(__name__)

# Errors after which a slot's owner must be looked up again (and the call retried by its caller).
RESLOT_ERRORS = (redis.ConnectionError, redis.TimeoutError, MovedError, ClusterDownError, TryAgainError,
                 ReadOnlyError)
# Everything a lost link, a restarting server or a failover can raise: a producer retries these
# (with backoff, within its request's time) instead of failing.  RedisClusterException is what
# redis-py's cluster client raises when no node it knows answers a topology refresh.
# (socket errors: the builtin ConnectionError, not OSError, which a refusal such as a PermissionError is)
LINK_ERRORS = (redis.BusyLoadingError, ConnectionError, RedisClusterException) + RESLOT_ERRORS


class RedisUnreachable(redis.ConnectionError, ConnectionError):
    """No Redis node answered within the time allowed; the message names the nodes tried.
    Both a ``redis.ConnectionError`` and a builtin ``ConnectionError``."""


def is_link_error(exc: BaseException) -> bool:
    """A lost link, a restarting server or a failover (retry it), not a refusal."""
    return isinstance(exc, LINK_ERRORS) or _closed_under_us(exc)


def _closed_under_us(exc: BaseException) -> bool:
    """redis-py's asyncio cluster client disconnects a node's connections when a topology refresh
    drops or recycles the node, also while another task is sending on one: that task then fails
    with an AttributeError from inside redis-py's connection code (its stream writer is None).
    It is a lost link like any other."""
    if not isinstance(exc, AttributeError):
        return False
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and tb.tb_frame.f_code.co_filename.replace("\\", "/").endswith("redis/asyncio/connection.py")


class Backoff:
    """Capped exponential backoff with full jitter, as rq's worker retries ``ConnectionError``: the
    n-th sleep in a row is drawn from [0, min(cap, first * 2**n)] (redis-py's ``FullJitterBackoff``),
    so that after a restart or a failover the workers, clients and gateways do not all retry on the
    same beat.  ``ok()`` after a success starts the next failure from ``first`` again."""

    def __init__(self, first: float = 0.05, cap: float = 1.0):
        self.first, self.cap, self.failures = first, cap, 0

    def ceiling(self) -> float:
        """The most the next sleep may be (the exponent stops growing once it is past the cap)."""
        return min(self.cap, self.first * 2 ** min(self.failures, 64))

    def fail(self) -> float:
        """The sleep before the next try, after one more failure."""
        delay = random.uniform(0, self.ceiling())
        self.failures += 1
        return delay

    def ok(self) -> None:
        self.failures = 0


class LinkWatch:
    """How one client's Redis links fare: a log line when they start failing and one when they
    work again, however many threads or tasks notice at once; the retry loops of its calls
    (backoff, a deadline, a topology refresh per failure on a cluster, at most one at a time)."""

    # A call's backoff: 50 ms, doubling to 2 s.
    FIRST_S, CAP_S = 0.05, 2.0
    # A failure this long after the one before starts a new outage: no retry loop ran in between (their
    # backoff is at most CAP_S, a call on a hung server at most the 20 s read timeout), so the links
    # worked, unseen, and an outage long over does not count against the give-up.
    STALE_S = 30.0

    def __init__(self, what: str, nodes: Callable[[], str], refresh: Optional[Callable[[], Any]] = None,
                 give_up_s: Optional[float] = None, give_up_timed: bool = True):
        self.what, self._nodes, self._refresh = what, nodes, refresh
        self.give_up_s = give_up_s  # past this long down, every retrying call fails (the gateway's 503)
        # whether a call with a deadline of its own gives up too (False: the clients' job waits, which
        # honour their timeout; the give-up ends a wait with none)
        self.give_up_timed = give_up_timed
        self._lock = threading.Lock()
        self._refreshing = threading.Lock()
        self._down_since: Optional[float] = None
        self._failed_at = 0.0
        self.last_error: Optional[BaseException] = None

    @classmethod
    def new_backoff(cls) -> Backoff:
        """The backoff of one retrying call (or one wait)."""
        return Backoff(cls.FIRST_S, cls.CAP_S)

    @property
    def down(self) -> bool:
        return self._down_since is not None

    def failed(self, exc: BaseException) -> None:
        with self._lock:
            now = time.monotonic()
            self.last_error = exc
            stale, self._failed_at = now - self._failed_at > self.STALE_S, now
            if self._down_since is not None and not stale:
                return
            self._down_since = now
        log.warning("%s: Redis link lost (%s: %s); retrying with backoff (nodes: %s)", self.what,
                    type(exc).__name__, exc, self._nodes())

    def ok(self) -> None:
        if self._down_since is None:
            return
        with self._lock:
            since, self._down_since = self._down_since, None
        if since is not None:
            log.warning("%s: Redis link back after %.1fs", self.what, time.monotonic() - since)

    def unreachable(self, exc: Optional[BaseException] = None) -> RedisUnreachable:
        exc = exc or self.last_error
        return RedisUnreachable(f"{self.what}: Redis unreachable (tried {self._nodes()}; last error: "
                                f"{type(exc).__name__}: {exc})")

    # -- the core: what a failure means ------------------------------------------------------------------

    def pause(self, exc: Exception, deadline: Optional[float], backoff: Backoff, is_link=None) -> float:
        """After a failed call: re-raise what is not a link failure (``is_link``, else
        :func:`is_link_error`), raise :class:`RedisUnreachable` past ``deadline`` (monotonic; None: no
        end) or past the give-up, else the seconds to sleep before the next try: drawn by ``backoff``,
        and never past ``deadline``, where the last try goes (a call gives up at its deadline, not at
        a draw before it)."""
        if not (is_link or is_link_error)(exc):
            raise exc
        self.failed(exc)
        now, since = time.monotonic(), self._down_since
        if deadline is not None and now >= deadline:
            raise self.unreachable(exc) from None
        if self.give_up_s is not None and since is not None and now - since > self.give_up_s \
                and (deadline is None or self.give_up_timed):
            raise self.unreachable(exc) from None
        sleep = backoff.fail()
        return sleep if deadline is None else min(sleep, max(0.0, deadline - now))

    @staticmethod
    def wants_refresh(exc: BaseException) -> bool:
        """Whether a failure calls for a topology refresh (a connection closed under us needs none)."""
        return isinstance(exc, LINK_ERRORS)

    @contextlib.contextmanager
    def _refresh_turn(self):
        """The refresh to run (None: the client has none, or another thread or task runs one now);
        one that fails is only logged (the next retry asks again)."""
        if self._refresh is None or not self._refreshing.acquire(blocking=False):
            yield None
            return
        try:
            yield self._refresh
        except Exception as exc:
            log.debug("topology refresh failed: %s", exc)
        finally:
            self._refreshing.release()

    # -- the thread transport ------------------------------------------------------------------------

    def refresh(self) -> None:
        """A topology refresh (a cluster), unless one is under way in another thread."""
        with self._refresh_turn() as refresh:
            if refresh is not None:
                refresh()

    def backoff(self, exc: Exception, deadline: Optional[float], backoff: Backoff, is_link=None) -> None:
        """After a failed call: :meth:`pause`, sleep it, refresh the topology."""
        time.sleep(self.pause(exc, deadline, backoff, is_link))
        if self.wants_refresh(exc):
            self.refresh()

    def call(self, fn: Callable[[], Any], deadline: Optional[float], is_link=None) -> Any:
        """``fn()`` until it returns; a link failure is retried with backoff until ``deadline``
        (monotonic; None: no end), then :class:`RedisUnreachable`."""
        backoff = self.new_backoff()
        while True:
            try:
                result = fn()
            except Exception as exc:
                self.backoff(exc, deadline, backoff, is_link)
                continue
            self.ok()
            return result

    # -- the asyncio transport -----------------------------------------------------------------------

    async def arefresh(self) -> None:
        """``refresh`` for an asyncio client (its refresh is a coroutine function)."""
        with self._refresh_turn() as refresh:
            if refresh is not None:
                await refresh()

    async def abackoff(self, exc: Exception, deadline: Optional[float], backoff: Backoff, is_link=None) -> None:
        """``backoff`` for asyncio code."""
        await asyncio.sleep(self.pause(exc, deadline, backoff, is_link))
        if self.wants_refresh(exc):
            await self.arefresh()

    async def acall(self, fn: Callable[[], Any], deadline: Optional[float], is_link=None) -> Any:
        """``call`` for coroutines: ``await fn()`` until it returns."""
        backoff = self.new_backoff()
        while True:
            try:
                result = await fn()
            except Exception as exc:
                await self.abackoff(exc, deadline, backoff, is_link)
                continue
            self.ok()
            return result
