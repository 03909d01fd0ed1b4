"""``Subscriber`` for asyncio: one pub/sub connection per node and one reader task per node
for every job of an ``AsyncClient`` (see ``mlxq.producer.subscriber``)."""

from __future__ import annotations

import asyncio
import logging
from typing import Optional

import redis

from ..shared.connection import nodes_tried
from ..shared.linkwatch import LinkWatch, is_link_error
from ..shared.slots import is_cluster, node_client_async, refresh_topology_async

from .errors import ClientClosed
from .core import Inboxes, channel_bytes

log = logging.getLogger(__name__)


class _NodeReader:
    def __init__(self, owner: "AsyncSubscriber", name: str, client):
        self.owner = owner
        self.node = name
        self.client = client  # a plain client on the node (ours to close on a cluster)
        self.pubsub = client.pubsub()
        self.channels: set[bytes] = set()
        self.confirm: dict[bytes, asyncio.Future] = {}
        self.task: Optional[asyncio.Task] = None
        self.failed = False
        self.lock = asyncio.Lock()  # one (un)subscribe command at a time on the link

    async def add(self, channel: bytes, timeout: float) -> None:
        if self.failed:
            raise self._down()
        fut = self.confirm.get(channel)
        if fut is None:  # else another handle on the job subscribed it: its confirmation is this one's
            fut = self.confirm[channel] = asyncio.get_running_loop().create_future()
            self.channels.add(channel)
            try:
                await self._subscribe(channel)
            except BaseException:  # (a cancel too) not sent: the handles sharing it retry now, not at the timeout
                self._not_sent(channel, fut)
                raise
            if self.task is None:  # (reading starts once a SUBSCRIBE went out)
                self.task = asyncio.ensure_future(self.run())
        try:
            await asyncio.wait_for(asyncio.shield(fut), timeout)
        except asyncio.TimeoutError:  # as the sync subscriber: a message, and a pause the caller retries
            raise redis.TimeoutError(f"subscription to {channel!r} not confirmed within {timeout}s") from None
        if self.failed:
            raise redis.ConnectionError(f"the pub/sub link to {self.node} dropped while subscribing")

    async def _subscribe(self, channel: bytes) -> None:
        try:
            async with self.lock:
                if self.failed:  # it failed while this one waited: no connect attempt per waiting channel
                    raise self._down()
                if self.owner.sharded:
                    await self.pubsub.ssubscribe(channel)
                else:
                    await self.pubsub.subscribe(channel)
        except Exception as exc:
            if is_link_error(exc):
                self.fail()
            raise

    def _not_sent(self, channel: bytes, fut: asyncio.Future) -> None:
        if self.confirm.get(channel) is fut:
            del self.confirm[channel]
            self.channels.discard(channel)
        if not fut.done():
            fut.set_exception(redis.ConnectionError(f"the subscription to {channel!r} was not sent"))
            fut.exception()  # (retrieved: no sharer may be waiting on it)

    def _down(self) -> redis.ConnectionError:
        return redis.ConnectionError(f"the pub/sub link to {self.node} is down")

    def fail(self) -> bool:
        """Mark the link failed (once) and wake the subscribers waiting on it."""
        if self.failed:
            return False
        self.failed = True
        for fut in self.confirm.values():
            if not fut.done():
                fut.set_result(None)
        return True

    async def remove(self, channel: bytes) -> None:
        if channel not in self.channels:
            return
        self.channels.discard(channel)
        self.confirm.pop(channel, None)
        if self.failed:
            return
        try:
            async with self.lock:
                if self.failed:
                    return
                if self.owner.sharded:
                    await self.pubsub.sunsubscribe(channel)
                else:
                    await self.pubsub.unsubscribe(channel)
        except Exception as exc:  # the link is gone (or closed under us by a topology refresh): nothing to undo
            if not is_link_error(exc):
                raise

    async def run(self) -> None:
        while True:
            try:
                msg = await self.pubsub.get_message(timeout=1.0)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if is_link_error(exc):
                    self.fail()
                    await self.owner._node_lost(self, exc)
                    return
                log.exception("pub/sub reader error")
                await asyncio.sleep(0.1)
                continue
            if msg is not None:
                self.owner.route(self, msg)

    def confirmed(self, channel: bytes) -> None:
        fut = self.confirm.get(channel)
        if fut is not None and not fut.done():
            fut.set_result(None)

    async def close(self) -> None:
        if self.task is not None and self.task is not asyncio.current_task():
            self.task.cancel()
            try:
                await self.task
            except (asyncio.CancelledError, Exception):
                pass
        try:
            await self.pubsub.aclose()
        except Exception:
            pass
        if self.owner.sharded:
            try:
                await self.client.aclose()
            except Exception:
                pass


class AsyncSubscriber(Inboxes):
    def __init__(self, client, confirm_timeout: float = 10.0):
        super().__init__(client, confirm_timeout)
        self.watch = link_watch("pub/sub", client)
        self._lock = asyncio.Lock()

    async def subscribe(self, channel: str | bytes, inbox: asyncio.Queue, confirm_s: Optional[float] = None) -> None:
        """As ``Subscriber.subscribe``."""
        ch = channel_bytes(channel)
        self.add_inbox(ch, inbox)
        try:
            reader = await self._reader_for(ch)
            await reader.add(ch, self.confirm_s(confirm_s))
        except BaseException as exc:
            await self.unsubscribe(ch, inbox)
            cut = self.cut_short(exc, confirm_s)
            if cut is None:
                raise
            raise cut from exc

    def drop(self, channel: str | bytes, inbox: asyncio.Queue) -> bool:
        """Drop ``inbox`` now (no await); True when it was the channel's last, whose server subscription
        stays until ``unsubscribe``."""
        return self.drop_inbox(channel_bytes(channel), inbox)

    async def unsubscribe(self, channel: str | bytes, inbox: Optional[asyncio.Queue] = None) -> None:
        """As ``Subscriber.unsubscribe``; ``inbox`` None: the server's subscription goes if no handle's
        inbox is left."""
        ch = channel_bytes(channel)
        if not self.drop_inbox(ch, inbox):
            return
        for r in list(self._readers.values()):
            await r.remove(ch)

    async def aclose(self) -> None:
        self._closed = True
        readers, self._readers = list(self._readers.values()), {}
        self._inboxes.clear()
        for r in readers:
            await r.close()

    async def _reader_for(self, channel: bytes) -> _NodeReader:
        async with self._lock:
            if self._closed:
                raise ClientClosed("the client is closed")
            if self.sharded:
                node = self.client.get_node_from_key(channel.decode(errors="replace"))
                name = f"{node.host}:{node.port}"
            else:
                node, name = None, "redis"
            reader = self._readers.get(name)
            if reader is not None and reader.failed and reader.task is None:
                asyncio.ensure_future(reader.close())  # it failed before it read anything
            if reader is None or reader.failed:
                conn = self.client if node is None else node_client_async(self.client, node)
                reader = self._readers[name] = _NodeReader(self, name, conn)
            return reader

    async def _node_lost(self, reader: _NodeReader, exc: Exception) -> None:
        """A reader's link dropped: move its channels to a fresh link (the slot's master now), then
        tell each job to read its durable record.  Runs in the failed reader's task, once."""
        self.forget(reader, exc)
        await reader.close()
        moved = list(reader.channels)
        # all at once: a link's confirmations come in one by one, and each job waits for its own
        await asyncio.gather(*(self.watch.acall(lambda ch=ch: self._resubscribe(ch), None, is_link=_resubscribe_again)
                               for ch in moved))
        self.resync(moved)

    async def _resubscribe(self, ch: bytes) -> None:
        """Subscribe ``ch`` on the link serving it now, unless its job stopped waiting for it (or
        the subscriber was closed)."""
        if ch in self._inboxes and not self._closed:
            await (await self._reader_for(ch)).add(ch, self.confirm_timeout)


def _resubscribe_again(exc: BaseException) -> bool:
    return isinstance(exc, asyncio.TimeoutError) or is_link_error(exc)


def link_watch(what: str, redis_client, give_up_s: Optional[float] = None, give_up_timed: bool = True) -> LinkWatch:
    """A LinkWatch for an asyncio client (a topology refresh per failure on a cluster)."""
    refresh = (lambda: refresh_topology_async(redis_client)) if is_cluster(redis_client) else None
    return LinkWatch(what, lambda: nodes_tried(redis_client), refresh, give_up_s, give_up_timed)

