"""The asyncio producer client: ``AsyncClient`` and ``AsyncJob``, ``Client``'s and ``Job``'s methods as coroutines
(``map`` and ``Job.stream`` as async iterators, ``close`` as ``aclose``; ``await client.model``)."""

from __future__ import annotations

import asyncio
import logging
import time
import warnings
from typing import Any, AsyncIterator, Optional, Union

from redis.exceptions import NoPermissionError, ResponseError

from ..shared import apikeys
from ..shared.connection import connect_async, replica_acked
from ..shared.keys import GlobalKeys, ModelKeys
from ..shared.linkwatch import LinkWatch
from ..shared.protocol import (SCRIPT_NAMES, CopyPolicy, Enqueued, ScriptCalls, cancel_steps, copy_policy,
                               enqueue_steps, fcall_failed, run_script, script_source)
from ..shared.schemas import Delta, Result
from ..shared.settings import Settings
from ..shared.slots import close_pins, for_slot, is_cluster, one_connection_async
from ..shared.steps import Steps, adrive, arun_steps

from .asubscriber import AsyncSubscriber, link_watch
from .bulkmap import amap_results
from .registry import decode_registry, known_model, pick_model, registry_unreadable, status_text
from .core import (REPLAY_FIELDS, SYNC, EmbedInput, Emit, Enqueue, JobHandle, Origin, Pause, Receive, Resubmit,
                   WaitDone, decode_status, embed_answer, embed_jobs, embed_kwargs, prepare, retryable, schema_of,
                   submission, submit_kwargs)

log = logging.getLogger(__name__)

class AsyncJob(JobHandle):
    """``Job`` for asyncio: the same core (``mlxq.producer.core.JobCore``), its reads awaited."""

    def __init__(self, client: "AsyncClient", job_id: str, keys: ModelKeys, pubsub, enqueued: Enqueued,
                 schema=None, origin: Optional[Origin] = None):
        super().__init__(client, job_id, keys, pubsub, enqueued, schema, origin)
        self._redis = client.at(keys.job(job_id))  # the model's slot (its master, pinned, on a cluster)

    async def stream(self, timeout: Optional[float] = None) -> AsyncIterator[Delta]:
        """As ``Job.stream``: a lost link is a pause; past ``timeout``, ``JobTimeout`` or
        ``RedisUnreachable`` while no Redis node answers; ``RedisUnreachable`` also once none has
        answered for ``settings.redis_outage_s``."""
        self._streaming = True
        try:
            async for d in self._drive(Steps(self._core.stream(timeout))):
                yield d
        finally:
            self._streaming = False
            # left early too (a break, a cancel): unsubscribe, or the channel stayed subscribed for
            # as long as the client lived; a later stream() subscribes again and replays the record
            await self._close_pubsub()

    async def result(self, timeout: Optional[float] = None) -> Result:
        """As ``Job.result``: waits on the job's done list (nothing per generated token)."""
        if self._core.result is not None:
            return self._core.result
        if not self._streaming:  # a result-only caller needs no token stream
            await self._close_pubsub()
        steps = Steps(self._core.wait_result(timeout))
        async for _ in self._drive(steps):
            pass
        return steps.value

    async def _drive(self, steps: Steps) -> AsyncIterator[Delta]:
        """As ``Job._drive``, each read awaited."""
        handlers = self._handlers()

        async def do(op):
            try:
                return await handlers[type(op)](op)
            except Exception as exc:
                log.debug("job %s: %s: %s: %s", self.id, type(op).__name__, type(exc).__name__, exc)
                raise

        async for _ in adrive(steps, do, Emit):
            pending = self._core.undelivered
            while pending:  # one at a time: a caller that leaves keeps the rest for its next stream()
                yield pending.popleft()

    # -- the reads of the core's requests ---------------------------------------------------------
    async def _io_receive(self, op: Receive) -> Optional[bytes]:
        if self._pubsub is None:
            await self._ensure_pubsub(op.confirm_s)
            return SYNC
        try:
            return await asyncio.wait_for(self._pubsub.get(), op.seconds)
        except asyncio.TimeoutError:
            return None

    async def _io_read_events(self, op) -> list:
        return await self._redis.xrange(self._keys.events(self.id), min=self._core.replay_from())

    async def _io_read_replay(self, op) -> list:
        return await self._redis.hmget(self._keys.job(self.id), *REPLAY_FIELDS)

    async def _io_read_record(self, op) -> dict:
        return await self._redis.hgetall(self._keys.job(self.id))

    async def _io_wait_done(self, op: WaitDone) -> None:
        await self._redis.blpop([self._keys.done(self.id)], timeout=op.seconds)

    async def _io_pause(self, op: Pause) -> None:
        await self._client.watch.abackoff(op.error, op.deadline, op.backoff, retryable)

    async def _io_resubmit(self, op: Resubmit) -> str:
        origin = self._core.origin
        job_id, payload = origin.again(op.resume_ids)
        enq = await self._client.retry(lambda: self._client._enqueue(Enqueue(self._keys.model, job_id, payload,
                                                                              origin.floor, origin.idempotency_key)))
        await self._close_pubsub()  # the next read subscribes the new job's channel and reads its record
        return enq.job_id

    async def cancel(self) -> str:
        return await self._client.retry(lambda: self._client._cancel(self._keys.model, self.id))

    async def status(self) -> Optional[str]:
        """As ``Job.status``: "queued, no live worker for MODEL" when no live worker can take it now."""
        s = decode_status(await self._client.retry(lambda: self._redis.hget(self._keys.job(self.id), "status")))
        if s != "queued":
            return s
        return status_text(s, self._keys.model, await self._client.model_info(self._keys.model),
                           self._client.settings.live_worker_s)

    async def _ensure_pubsub(self, confirm_s: Optional[float] = None) -> asyncio.Queue:
        if self._pubsub is None:
            inbox: asyncio.Queue = asyncio.Queue()
            # returns once the server confirmed it: before the record is read (or the job enqueued)
            try:
                await self._client.subscriber.subscribe(self._keys.channel(self.id), inbox, confirm_s)
            except BaseException:  # not confirmed (a cancel, a timeout): what was asked is undone
                await self._client.subscriber.unsubscribe(self._keys.channel(self.id), inbox)
                raise
            self._pubsub = inbox
        return self._pubsub

    async def _close_pubsub(self) -> None:
        if self._pubsub is not None:
            inbox, self._pubsub = self._pubsub, None
            await self._client.subscriber.unsubscribe(self._keys.channel(self.id), inbox)

    def __del__(self):
        # dropped while subscribed (fire and forget, or only status() polled): its messages piled up in
        # an inbox for the client's lifetime. No await here: the inbox goes now, the server's
        # subscription at the client's next submit (AsyncClient._unsubscribe_dropped)
        try:
            if self._pubsub is not None:
                inbox, self._pubsub = self._pubsub, None
                channel = self._keys.channel(self.id)
                if self._client.subscriber.drop(channel, inbox):  # the job's last handle
                    self._client._dropped.append(channel)
        except Exception:  # noqa: BLE001 - never from a finalizer
            pass


# A prompt longer than this (characters) is prepared on a worker thread, not on the event loop.
OFF_LOOP_CHARS = 32 * 1024


def _text_size(prompt, messages) -> int:
    """Characters of a submission's prompt or messages' contents (any shape they come in)."""
    if isinstance(prompt, str):
        return len(prompt)
    total = 0
    for m in messages or ():
        content = m.get("content") if isinstance(m, dict) else getattr(m, "content", None)
        total += len(content) if isinstance(content, (str, list)) else 0
    return total


class DefaultModel:
    """``AsyncClient.model``: awaited, the model the client submits to when none is given (the one
    client's settings' ``model`` names, else the only one workers serve), as ``Client.model`` is on the sync client."""

    def __init__(self, client: "AsyncClient"):
        self._client = client

    def __await__(self):
        return self._client._default_model().__await__()

    def __call__(self):
        warnings.warn("AsyncClient.model() is deprecated: use `await client.model`, as Client.model",
                      DeprecationWarning, stacklevel=2)
        return self._client._default_model()


class AsyncClient:
    """``Client`` for asyncio code (web backends, agents)."""

    def __init__(self, redis_url: Optional[str] = None, api_key: Optional[str] = None,
                 model: Optional[str] = None, *, settings: Optional[Settings] = None, redis_client=None,
                 subscriber: Optional[AsyncSubscriber] = None, watch: Optional[LinkWatch] = None):
        self.settings = settings or Settings.from_env()
        url = redis_url or self.settings.redis_url
        if redis_client is None and not url:
            raise ValueError("no Redis URL: pass redis_url= or set MLXQ_REDIS_URL")
        if redis_client is None:
            redis_client = connect_async(url, wait_s=self.settings.redis_outage_s)
        self.redis = redis_client
        self.api_key = api_key
        self._model = model
        self.gkeys = GlobalKeys(self.settings.prefix)
        self._scripts = {n: self.redis.register_script(script_source(n)) for n in SCRIPT_NAMES}
        self.cluster = is_cluster(self.redis)
        self.functions = False  # set when this Redis user may FCALL but not EVALSHA (enqueue_steps)
        self._url = url
        self._pins: dict = {}  # per-slot pins, when the cluster client keeps none itself
        self.closed = False  # set by aclose(): every job's wait then raises ClientClosed
        self._own_subscriber = subscriber is None  # a shared one (the gateway's) is closed by its owner
        self._dropped: list = []  # channels of jobs dropped while subscribed (AsyncJob.__del__)
        # one pub/sub connection per node for every job of this client; made here, not on first use
        self.subscriber: AsyncSubscriber = subscriber if subscriber is not None else AsyncSubscriber(self.redis)
        # a wait with no timeout ends too: RedisUnreachable once the links stayed down redis_outage_s
        self.watch = watch or link_watch("mlxq async client", self.redis, give_up_s=self.settings.redis_outage_s,
                                         give_up_timed=False)

    async def retry(self, fn, deadline: Optional[float] = None):
        """``await fn()``, retried through a lost link for up to ``settings.redis_outage_s``.
        Public for code that reads or writes a job's own keys beside the client (``client.at(key)``),
        as the gateway's Responses room does with its stored response."""
        if deadline is None:
            deadline = time.monotonic() + self.settings.redis_outage_s
        return await self.watch.acall(fn, deadline, is_link=retryable)

    def at(self, key: str):
        """The client for ``key``'s slot: ``self.redis`` on a single Redis; on a cluster a plain
        client on the slot's master, shared by every task, re-resolved once per failover."""
        return for_slot(self.redis, key, self._pins)

    def calls(self, model: str) -> ScriptCalls:
        return ScriptCalls(self.gkeys.model_keys(model), self.settings, self.cluster)

    async def _run_steps(self, gen, model: str):
        """Await the I/O of ``enqueue_steps`` / ``cancel_steps`` (``mlxq.shared.protocol``)."""
        async def do(op):
            if isinstance(op, CopyPolicy):
                # no worker has served this model yet: a trusted client copies the registry into its slot
                return await asyncio.to_thread(self._copy_policy_blocking, model)
            if op.acked:
                return await self._run_acked(op.call, op.acked)
            return await self._run(op.call, read_only=op.read_only)

        return await arun_steps(gen, do)

    async def _run_acked(self, call, job_id: str):
        """As ``Queue._run_acked``: with ``submit_replica_ack_ms`` set, ``WAIT 1 <ms>`` after the submit,
        on its connection."""
        wait_ms = self.settings.submit_replica_ack_ms
        if not wait_ms:
            return await self._run(call)
        async with one_connection_async(self.at(call[1][0])) as conn:
            reply = await self._run(call, client=conn)
            acked = await conn.execute_command("WAIT", 1, wait_ms)
        replica_acked(acked, job_id, wait_ms)
        return reply

    async def _run(self, call, read_only: bool = False, client=None):
        """As ``Queue.run``: on the slot of the call's first key."""
        keys = call[1]
        r = client or (self.at(keys[0]) if keys else self.redis)
        try:
            return await run_script(r, self._scripts, call, self.functions, read_only)
        except ResponseError as exc:
            if self.functions:
                fcall_failed(exc)
            raise

    async def _enqueue(self, op: Enqueue) -> Enqueued:
        """``Queue.enqueue``, awaited."""
        return await self._run_steps(enqueue_steps(self, self.calls(op.model), op.job_id, op.payload, self.key_hash,
                                                   op.floor, op.idempotency_key), op.model)

    async def _cancel(self, model: str, job_id: str) -> str:
        """``Queue.cancel``, awaited."""
        return await self._run_steps(cancel_steps(self, self.calls(model), job_id), model)

    def _copy_policy_blocking(self, model: str) -> None:
        from ..shared.connection import connect

        keys = self.gkeys.model_keys(model)
        r = connect(self._url) if self._url is not None else None
        try:
            copy_policy(r, for_slot(r, keys.policy) if r is not None else None, keys)
        finally:
            if r is not None:
                r.close()

    async def models(self) -> dict[str, dict]:
        return decode_registry(await self.retry(lambda: self.at(self.gkeys.models).hgetall(self.gkeys.models)))

    async def _registry(self) -> Optional[dict[str, dict]]:
        """``models()``, or None for a Redis user that may not read the registry (ACL)."""
        try:
            return await self.models()
        except NoPermissionError as exc:
            registry_unreadable(exc)
            return None

    async def model_info(self, model: str) -> Optional[dict]:
        """One model's entry in the workers' registry (as ``models()`` gives it): {} when no worker
        registered it, None when this Redis user may not read the registry (ACL)."""
        registry = await self._registry()
        return None if registry is None else registry.get(model, {})

    @property
    def model(self) -> "DefaultModel":
        """The model this client submits to when none is given, as ``Client.model``: ``await
        client.model``.  (``await client.model()``, the spelling before, still works and warns.)"""
        return DefaultModel(self)

    async def _default_model(self) -> str:
        if self._model is None:
            self._model = pick_model(self.settings.model, await self.models())
        return self._model

    @property
    def key_hash(self) -> Optional[str]:
        """As ``Client.key_hash``: what enqueue sends, sha256 of the API key."""
        return apikeys.key_hash(self.api_key) if self.api_key is not None else None

    async def tier(self, floor: Optional[str] = None) -> str:
        """As ``Client.tier``."""
        return await self.retry(lambda: self._tier(floor))

    async def _tier(self, floor: Optional[str]) -> str:
        """``apikeys.resolve_tier``, awaited: each read on its key's slot."""
        async def read(op: apikeys.Read):
            r = self.at(op.key)
            return await (r.hget(op.key, op.field) if op.field else r.exists(op.key))

        return await arun_steps(apikeys.tier_steps(self.gkeys, self.api_key, floor), read)

    async def submit(self, prompt: Optional[str] = None, *, messages: Optional[list] = None,
                     prompt_tokens: Optional[list[int]] = None, model: Optional[str] = None,
                     idempotency_key: Optional[str] = None, session_id: Optional[str] = None,
                     subscribe: bool = True, _floor: Optional[str] = None, _source: str = "client",
                     _count_tokens=None, **params: Any) -> AsyncJob:
        """As ``Client.submit`` (the same core: ``mlxq.producer.core.submission``); a long prompt is
        prepared on a worker thread, off the event loop."""
        await self._unsubscribe_dropped()
        model = model or await self.model
        args = (model, submit_kwargs(prompt, messages, prompt_tokens, session_id, _source, params),
                known_model(model, await self._registry()), self.settings.max_prompt_bytes, _count_tokens,
                self.settings)
        if _text_size(prompt, messages) > OFF_LOOP_CHARS or params.get("webhook"):  # (a webhook's host is resolved)
            # validating, packing and (the gateway) tokenizing a long prompt: seconds for a few MiB, in
            # which every other request and stream on this loop stood still
            prep = await asyncio.to_thread(prepare, *args)
        else:
            prep = prepare(*args)
        keys = self.gkeys.model_keys(model)
        origin = Origin.of(prep, _floor, idempotency_key)
        job = AsyncJob(self, prep.request.id, keys, None, None, prep.schema, origin)
        io = job._submit_handlers(time.monotonic() + self.settings.redis_outage_s)
        enq = await arun_steps(submission(model, prep, _floor, idempotency_key, subscribe), lambda op: io[type(op)](op))
        if enq.status == "duplicate":
            return AsyncJob(self, enq.job_id, keys, None, enq, prep.schema, origin)
        job.enqueued = enq
        return job

    async def _unsubscribe_dropped(self) -> None:
        while self._dropped:
            try:
                await self.subscriber.unsubscribe(self._dropped.pop())
            except Exception:  # noqa: BLE001 - a lost link drops the subscription anyway
                pass

    async def job(self, job_id: str, model: Optional[str] = None, response_format=None, *,
                  _origin: Optional[Origin] = None) -> AsyncJob:
        """As ``Client.job``."""
        keys = self.gkeys.model_keys(model or await self.model)
        return AsyncJob(self, job_id, keys, None, Enqueued("existing", job_id, None, None), schema_of(response_format),
                        _origin)

    async def embed(self, input: EmbedInput, *, model: Optional[str] = None, dimensions: Optional[int] = None,
                    pooling: Optional[str] = None, normalize: bool = True, timeout: Optional[float] = None,
                    _floor: Optional[str] = None) -> Union[list[float], list[list[float]]]:
        """As ``Client.embed`` (the same core: ``mlxq.producer.core.embed_jobs``), the jobs awaited together."""
        model = model or await self.model
        jobs, single = embed_jobs(model, input, embed_kwargs(dimensions, pooling, normalize),
                                  known_model(model, await self._registry()), self.settings.max_prompt_bytes)
        handles = [await self.submit(model=model, _floor=_floor, **kw) for kw in jobs]
        return embed_answer(await asyncio.gather(*(h.result(timeout) for h in handles)), single)

    def map(self, items, **params: Any) -> AsyncIterator[Result]:
        """As ``Client.map``, an async iterator: ``async for res in client.map(prompts, max_tokens=64)``.
        Same options (window=, timeout=, idempotency_prefix=, webhook= per run, defaults for every
        item) and the same core (``mlxq.producer.bulkmap``).  Left before its end, it cancels the jobs it still had queued
        (unless an idempotency_prefix lets a later call find them) once the iterator is closed: at
        once under ``contextlib.aclosing(client.map(...))``, else when Python collects it."""
        return amap_results(self, items, **params)

    async def aclose(self) -> None:
        """As ``Client.close``: a ``result()`` or ``stream()`` waiting in another task raises
        ``ClientClosed``."""
        self.closed = True
        if self._own_subscriber:
            await self.subscriber.aclose()
        for pin in self._pins.values():
            await pin.aclose()
        await close_pins(self.redis)
        await self.redis.aclose()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.aclose()
