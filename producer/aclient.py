"""The asyncio producer client: ``AsyncClient`` and ``AsyncJob``, same methods as coroutines."""

from __future__ import annotations

import time
from typing import Any, AsyncIterator, Optional

import redis.asyncio as aredis

from mlxq.shared import apikeys, codec
from mlxq.shared.keys import GlobalKeys, ModelKeys
from mlxq.shared.protocol import Enqueued, ScriptCalls, parse_enqueue, script_source, SCRIPT_NAMES
from mlxq.shared.schemas import Delta, Result
from mlxq.shared.settings import Settings
from .common import (JobTimeout, StreamState, build_request, check_fits, decode_registry, entry_delta,
                     pick_model, result_from_hash)


class AsyncJob:
    def __init__(self, client: "AsyncClient", job_id: str, keys: ModelKeys, pubsub, enqueued: Enqueued):
        self.id = job_id
        self._client = client
        self._keys = keys
        self._pubsub = pubsub
        self.enqueued = enqueued
        self._state = StreamState()
        self._last_id = "0-0"
        self._result: Optional[Result] = None
        self._streaming = False  # a stream() is reading the subscription

    @property
    def duplicate(self) -> bool:
        return self.enqueued.status == "duplicate"

    async def _replay(self) -> list[Delta]:
        out: list[Delta] = []
        start = f"({self._last_id}" if self._last_id != "0-0" else "-"
        for entry_id, fields in await self._client.redis.xrange(self._keys.events(self.id), min=start):
            self._last_id = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
            out.extend(self._state.feed(entry_delta(fields)))
        return out

    async def stream(self, timeout: Optional[float] = None) -> AsyncIterator[Delta]:
        deadline = None if timeout is None else time.monotonic() + timeout
        pubsub = await self._ensure_pubsub()
        self._streaming = True
        try:
            for d in await self._replay():
                yield d
            while not self._state.done:
                if deadline is not None and time.monotonic() > deadline:
                    raise JobTimeout(f"job {self.id} did not finish within {timeout}s")
                msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                if msg is None or msg.get("type") != "message" or msg["data"] == b"sync":
                    for d in await self._replay():
                        yield d
                    continue
                try:
                    delta = Delta.from_wire(codec.unpack(msg["data"]))
                except (codec.CodecError, ValueError, TypeError):
                    continue
                for d in self._state.feed(delta):
                    yield d
                if self._state.gap:
                    for d in await self._replay():
                        yield d
        finally:
            self._streaming = False
            if self._state.done:
                await self._close_pubsub()

    async def result(self, timeout: Optional[float] = None) -> Result:
        """Wait for the final result on the job's done list (nothing per generated token)."""
        if self._result is not None:
            return self._result
        if not self._streaming:  # a result-only caller needs no token stream
            await self._close_pubsub()
        deadline = None if timeout is None else time.monotonic() + timeout
        r = self._client.redis
        while True:
            res = result_from_hash(self.id, await r.hgetall(self._keys.job(self.id)))
            if res is not None:
                self._result = res
                return res
            wait = 1.0 if deadline is None else min(1.0, deadline - time.monotonic())
            if wait <= 0:
                raise JobTimeout(f"job {self.id} did not finish within {timeout}s")
            await r.blpop([self._keys.done(self.id)], timeout=max(0.01, wait))

    async def cancel(self) -> str:
        return await self._client._run(self._client.calls(self._keys.model).cancel(self.id), decode=True)

    async def status(self) -> Optional[str]:
        s = await self._client.redis.hget(self._keys.job(self.id), "status")
        return s.decode() if s else None

    async def _ensure_pubsub(self):
        if self._pubsub is None:
            self._pubsub = self._client.redis.pubsub()
            await self._pubsub.subscribe(self._keys.channel(self.id))
            await self._pubsub.get_message(timeout=1.0)  # confirmed before the record is read
        return self._pubsub

    async def _close_pubsub(self) -> None:
        if self._pubsub is not None:
            ps, self._pubsub = self._pubsub, None
            await ps.aclose()


class AsyncClient:
    """``Client`` for asyncio code (web backends, agents)."""

    def __init__(self, redis_url: Optional[str] = None, api_key: Optional[str] = None,
                 model: Optional[str] = None, *, settings: Optional[Settings] = None, redis_client=None):
        self.settings = settings or Settings.from_env()
        url = redis_url or self.settings.redis_url
        if redis_client is None and not url:
            raise ValueError("no Redis URL: pass redis_url= or set MLXQ_REDIS_URL")
        self.redis = redis_client or aredis.Redis.from_url(url, health_check_interval=30,
                                                                   max_connections=10_000)
        self.api_key = api_key
        self._model = model
        self.gkeys = GlobalKeys(self.settings.prefix)
        self._scripts = {n: self.redis.register_script(script_source(n)) for n in SCRIPT_NAMES}

    def calls(self, model: str) -> ScriptCalls:
        return ScriptCalls(self.gkeys.model_keys(model), self.settings)

    async def _run(self, call, decode: bool = False):
        name, keys, args = call
        reply = await self._scripts[name](keys=keys, args=args)
        return reply.decode() if decode and isinstance(reply, bytes) else reply

    async def models(self) -> dict[str, dict]:
        return decode_registry(await self.redis.hgetall(self.gkeys.models))

    async def model(self) -> str:
        if self._model is None:
            self._model = pick_model(None, await self.models())
        return self._model

    async def tier(self, floor: Optional[str] = None) -> str:
        record = await self.redis.hget(self.gkeys.api_keys, apikeys.key_hash(self.api_key)) if self.api_key else None
        keys_exist = record is not None or not self.api_key or bool(await self.redis.exists(self.gkeys.api_keys))
        tier = apikeys.tier_from_record(record, self.api_key, keys_exist)
        return apikeys.lower_tier(tier, floor) if floor else tier

    async def submit(self, prompt: Optional[str] = None, *, messages: Optional[list] = None,
                     prompt_tokens: Optional[list[int]] = None, model: Optional[str] = None,
                     idempotency_key: Optional[str] = None, session_id: Optional[str] = None,
                     subscribe: bool = True, _floor: Optional[str] = None, _source: str = "client",
                     _count_tokens=None, **params: Any) -> AsyncJob:
        model = model or await self.model()
        req = build_request(model, dict(prompt=prompt, messages=messages, prompt_tokens=prompt_tokens,
                                        session_id=session_id, source=_source, submitted_at=time.time(), **params))
        check_fits(req, (await self.models()).get(model), _count_tokens)
        payload = codec.pack(req.model_dump(mode="json", exclude_none=True))
        if len(payload) > self.settings.max_prompt_bytes:
            raise ValueError(f"request of {len(payload)} bytes exceeds the {self.settings.max_prompt_bytes}-byte limit")
        tier = await self.tier(_floor)
        keys = self.gkeys.model_keys(model)
        job = AsyncJob(self, req.id, keys, None, None)
        if subscribe:  # subscribed before the job exists; stream() also replays the durable record
            await job._ensure_pubsub()
        try:
            enq = parse_enqueue(await self._run(self.calls(model).enqueue(req.id, payload, tier, idempotency_key)))
        except Exception:
            await job._close_pubsub()
            raise
        if enq.status == "duplicate":
            await job._close_pubsub()
            return AsyncJob(self, enq.job_id, keys, None, enq)
        job.enqueued = enq
        return job

    async def job(self, job_id: str, model: Optional[str] = None) -> AsyncJob:
        keys = self.gkeys.model_keys(model or await self.model())
        return AsyncJob(self, job_id, keys, None, Enqueued("existing", job_id, None, None))

    async def aclose(self) -> None:
        await self.redis.aclose()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.aclose()
