"""One pub/sub connection per Redis node for all of a client's jobs.

``Subscriber`` keeps one ``PubSub`` per node (one node on a single Redis; on a
cluster the node serving the channel's slot, with ``SSUBSCRIBE``) and one
reader thread per node that hands each message to the inbox of the job whose
channel it came on.  ``subscribe`` returns only once the server confirmed the
subscription, so a job is still subscribed before it is enqueued.

A lost link (a restart, a failover) is not fatal: the reader reconnects,
subscribes every channel again (on the slot's new master on a cluster), and
puts ``SYNC`` into each inbox so each job re-reads its durable record.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Optional

import redis

from ..shared.connection import nodes_tried
from ..shared.linkwatch import LINK_ERRORS, LinkWatch
from ..shared.slots import SlotRedis, refresh_topology
from .errors import ClientClosed
from .core import Inboxes, channel_bytes

log = logging.getLogger(__name__)


class _NodeReader(threading.Thread):
    """One node's pub/sub link and the thread reading it.  Started once (under ``lock``), failed
    once: the first of the reader or a subscriber to see the link drop marks it ``failed``; the
    reader thread then hands its channels to a fresh link (``Subscriber._node_lost``)."""

    def __init__(self, owner: "Subscriber", name: str, client: redis.Redis):
        super().__init__(name=f"mlxq-sub-{name}", daemon=True)
        self.owner = owner
        self.node = name
        self.pubsub = client.pubsub()
        self.channels: set[bytes] = set()
        self.confirm: dict[bytes, threading.Event] = {}
        self.lock = threading.RLock()
        self.started = False
        self.stopped = False
        self.failed = threading.Event()
        self.error: Optional[BaseException] = None
        self.wakeup = threading.Event()  # set when a channel is added (an idle reader sleeps on it)

    def add(self, channel: bytes, timeout: float) -> None:
        with self.lock:
            if self.failed.is_set():
                raise redis.ConnectionError(f"the pub/sub link to {self.node} is down")
            ev = self.confirm.get(channel)
            if ev is None:  # else another handle on the job subscribed it: its confirmation is this one's
                ev = self.confirm[channel] = threading.Event()
                self.channels.add(channel)
                try:
                    if self.owner.sharded:
                        self.pubsub.ssubscribe(channel)
                    else:
                        self.pubsub.subscribe(channel)
                except LINK_ERRORS as exc:
                    self.fail(exc)
                    raise
                except BaseException:  # not sent: a later handle must not wait on its confirmation
                    del self.confirm[channel]
                    self.channels.discard(channel)
                    raise
            if not self.started:  # many threads subscribe at once: one of them starts the reader
                self.started = True
                self.start()
        self.wakeup.set()
        if not ev.wait(timeout):
            raise redis.TimeoutError(f"subscription to {channel!r} not confirmed within {timeout}s")
        if self.failed.is_set():
            raise redis.ConnectionError(f"the pub/sub link to {self.node} dropped while subscribing")

    def fail(self, exc: BaseException) -> bool:
        """Mark the link failed (once) and wake the subscribers waiting on it; False if it already was."""
        with self.lock:
            if self.failed.is_set():
                return False
            self.error = exc
            self.failed.set()
            waiting = list(self.confirm.values())
        for ev in waiting:
            ev.set()  # they see `failed`
        self.wakeup.set()
        return True

    def remove(self, channel: bytes) -> None:
        with self.lock:
            if channel not in self.channels:
                return
            self.channels.discard(channel)
            self.confirm.pop(channel, None)
            if self.failed.is_set():
                return
            try:
                if self.owner.sharded:
                    self.pubsub.sunsubscribe(channel)
                else:
                    self.pubsub.unsubscribe(channel)
            except (*LINK_ERRORS, OSError, ValueError):
                # the link is gone; nothing is subscribed there any more. OSError / ValueError: redis-py
                # reconnecting on this call can read a socket the reader thread has just closed ("Bad file
                # descriptor", then "I/O operation on closed file", as when a Cluster master is killed)
                pass

    def run(self) -> None:
        while not self.stopped and not self.failed.is_set():
            try:
                if not self.pubsub.subscribed:  # nothing to read: sleep until a channel is added
                    self.wakeup.wait(1.0)
                    self.wakeup.clear()
                    continue
                msg = self.pubsub.get_message(timeout=1.0)
            except (*LINK_ERRORS, OSError, ValueError) as exc:
                # a lost link; OSError / ValueError too: the socket closed under this read by a thread
                # that reconnected on it ("I/O operation on closed file"; a Cluster master killed).
                # One warning line (Inboxes.forget), not a traceback: the channels move to a new link
                if self.stopped:
                    return
                self.fail(exc)
                break
            except Exception:
                if self.stopped:
                    return
                log.exception("pub/sub reader error")
                continue
            if msg is not None:
                self.owner.route(self, msg)
        if not self.stopped:
            self.owner._node_lost(self, self.error)

    def confirmed(self, channel: bytes) -> None:
        ev = self.confirm.get(channel)
        if ev is not None:
            ev.set()

    def close(self) -> None:
        self.stopped = True
        self.wakeup.set()
        try:
            self.pubsub.close()
        except Exception:
            pass


class Subscriber(Inboxes):
    """Multiplexes every job's channel of one client over one connection per node."""

    def __init__(self, client, confirm_timeout: float = 10.0, watch: Optional[LinkWatch] = None):
        super().__init__(client, confirm_timeout)
        self.watch = watch or LinkWatch("pub/sub", lambda: nodes_tried(client),
                                        (lambda: refresh_topology(client)) if self.sharded else None)
        self._lock = threading.RLock()

    # -- the jobs' side -----------------------------------------------------
    def subscribe(self, channel: str | bytes, inbox: "queue.Queue[bytes]", confirm_s: Optional[float] = None) -> None:
        """Route ``channel``'s messages to ``inbox``; returns once the server confirmed it (waited for
        at most ``confirm_s``, and never past ``confirm_timeout``)."""
        ch = channel_bytes(channel)
        with self._lock:
            self.add_inbox(ch, inbox)
        try:
            self._reader_for(ch).add(ch, self.confirm_s(confirm_s))
        except Exception as exc:
            self.unsubscribe(ch, inbox)
            cut = self.cut_short(exc, confirm_s)
            if cut is None:
                raise
            raise cut from exc

    def unsubscribe(self, channel: str | bytes, inbox: "Optional[queue.Queue[bytes]]" = None) -> None:
        """Stop routing ``channel`` to ``inbox``; the server's subscription goes with the last handle's
        inbox (under the lock: a handle subscribing the channel meanwhile goes after it)."""
        ch = channel_bytes(channel)
        with self._lock:
            if not self.drop_inbox(ch, inbox):
                return
            for r in list(self._readers.values()):
                r.remove(ch)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            readers, self._readers = list(self._readers.values()), {}
            self._inboxes.clear()
        for r in readers:
            r.close()

    # -- the readers' side --------------------------------------------------
    def _node_client(self, channel: bytes) -> tuple[str, redis.Redis]:
        if self.sharded:
            slot = SlotRedis(self.client, channel.decode(errors="replace"))
            node = slot.current()
            kw = node.connection_pool.connection_kwargs
            return f"{kw.get('host')}:{kw.get('port')}", node
        return "redis", self.client

    def _reader_for(self, channel: bytes) -> _NodeReader:
        name, node = self._node_client(channel)
        with self._lock:
            if self._closed:
                raise ClientClosed("the client is closed")
            reader = self._readers.get(name)
            if reader is not None and reader.failed.is_set() and not reader.started:
                reader.close()  # it failed before it read anything: nothing else will close it
            if reader is None or reader.failed.is_set():
                reader = self._readers[name] = _NodeReader(self, name, node)
            return reader

    def _node_lost(self, reader: _NodeReader, exc: Optional[BaseException]) -> None:
        """A reader's link dropped: move its channels to a fresh link (the slot's master now),
        then tell each job to read its durable record (messages sent meanwhile are in it).
        Runs on the failed reader's own thread, once per failed link."""
        with self._lock:
            self.forget(reader, exc)
        reader.close()
        with reader.lock:
            moved = list(reader.channels)
        for ch in moved:
            if self._closed:
                return
            self._move(ch)
        self.resync(moved)

    def _move(self, ch: bytes) -> None:
        """Subscribe ``ch`` on the link that serves it now, retrying (with backoff, a topology
        refresh each time on a cluster) while no node answers; a job that stopped waiting for
        it (unsubscribed) ends the retries."""
        def attempt() -> None:
            if ch in self._inboxes and not self._closed:
                self._reader_for(ch).add(ch, self.confirm_timeout)
        self.watch.call(attempt, None)


def new_inbox() -> "queue.Queue[bytes]":
    return queue.Queue()


def get(inbox: "queue.Queue[bytes]", timeout: float) -> Optional[bytes]:
    try:
        return inbox.get(timeout=timeout)
    except queue.Empty:
        return None
