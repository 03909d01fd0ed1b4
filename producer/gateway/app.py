"""``mlxq gateway``: an OpenAI-compatible HTTP front end; a producer in its own process.

    POST /v1/chat/completions, /v1/completions        (stream or not; usage from the job's stats)
    POST /v1/batch/chat/completions, /v1/batch/completions   (the same at the low tier)
    GET  /v1/models                                     (models that live workers serve)
    GET  /metrics                                       (this gateway's request metrics)
    GET  /health                                        (liveness: no key, no Redis; always 200 while serving)
    GET  /ready                                         (Redis answers and some model has a live worker)

The bearer token is an mlxq API key: it decides the tier.  Two modes, as vLLM, ollama and mlx-lm's
server behave: while no key is registered the gateway is open (any token, e.g. the openai client's
``api_key="EMPTY"``, is normal tier; a warning is logged at start); once any key exists, an unknown
or revoked token gets 401 on every endpoint, and so does a request with no token, unless the admin
let anonymous callers in (``mlxq tiers --anonymous normal|low``).  The start-up log says which mode.

Each request becomes one queue job through ``AsyncClient``; a stream reads the job's token channel.
A request that cannot run gets a 400 before anything is streamed: what can be checked up front is
(parameters, prompt length, token ids); a stream's headers wait for the job's first delta, so a job
the worker refuses is also a plain 400, unless the job waits longer than ``sse_keepalive_s`` in the
queue: then the headers go out with an SSE comment (``: keep-alive``) every ``sse_keepalive_s``, so that
a proxy's idle timeout does not cut a low-tier stream, and a refusal after that is an error event
(OpenAI's error chunk, no ``[DONE]``).  A client that disconnects cancels its job.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import threading
import time
from typing import Any, AsyncIterator, Optional

import redis.asyncio as aredis
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..asubscriber import AsyncSubscriber, link_watch
from ...shared.connection import LINK_ERRORS, RedisUnreachable, close_pins, connect_async
from ...shared import apikeys
from ...shared.apikeys import AuthError
from ...shared.keys import GlobalKeys
from ...shared.protocol import JobRefused, OverloadError
from ...shared.schemas import INVALID_REQUEST, Delta, GenerateRequest, Result
from ...shared.settings import Settings
from ..aclient import AsyncClient, AsyncJob
from ..common import ContextLengthError, NoModelError, has_live_worker
from ...shared.tools import check_format, format_from_info, uses_tools
from ..openai_api import (ChatCompletionRequest, ChatDeltas, CompletionRequest, LogprobFormatter, OpenAIError,
                         TokenNames, check_bias_vocab, choice, failed_output, finish_fields, now_s, usage,
                         validation_error)

log = logging.getLogger("mlxq.gateway")


def jlog(level: int, job_id: str, attempt: int, msg: str, *args: Any) -> None:
    """A log line about a job: ``job=<id> attempt=<n>`` first, and as record fields for JSON logs."""
    log.log(level, "job=%s attempt=%d " + msg, job_id, attempt, *args, extra={"job": job_id, "attempt": attempt})


class GatewayMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("mlxq_gateway_requests", "HTTP requests", ["endpoint", "status"], registry=r)
        # by tier: a low-tier job waits behind the others by design, and one histogram of all tiers
        # would hide whether the interactive ones meet their target
        self.latency = Histogram("mlxq_gateway_request_seconds", "Request time to the last byte",
                                 ["endpoint", "tier"], registry=r,
                                 buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300))
        self.ttft = Histogram("mlxq_gateway_ttft_seconds", "Request to first streamed token", ["endpoint", "tier"],
                              registry=r, buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
        self.inflight = Gauge("mlxq_gateway_inflight_requests", "Requests being served", registry=r)
        self.tokens = Counter("mlxq_gateway_completion_tokens", "Completion tokens returned", registry=r)
        self.cancels = Counter("mlxq_gateway_disconnect_cancels",
                               "Jobs cancelled on client disconnect (or when a failed sample ended an n > 1 stream)",
                               registry=r)
        self.errors = Counter("mlxq_gateway_errors", "Error responses by type", ["type"], registry=r)
        self.keepalives = Counter("mlxq_gateway_sse_keepalives", "SSE keep-alive comments sent to streams "
                                  "waiting for their first token", registry=r)
        # who sends the load, by the key's name (`mlxq keys create --name`), never the key or its hash:
        # "anonymous" for no key, "unnamed" for a key registered without a name (the open mode's any
        # token counts as anonymous too); as few values as the operator made keys
        self.key_requests = Counter("mlxq_gateway_key_requests", "Jobs submitted, by the API key's name", ["key"],
                                    registry=r)
        # no queue depth here: it is a figure of the queue, not of this process, and every gateway (and
        # worker) exporting it would make sum() count it once per exporter; one worker per model exports
        # it (worker/metrics.py)


class Gateway:
    """The application state: one Redis connection pool, shared by every request's AsyncClient."""

    def __init__(self, redis_url: Optional[str] = None, settings: Optional[Settings] = None):
        self.settings = settings or Settings.from_env(redis_url=redis_url)
        self.redis_url = redis_url or self.settings.redis_url
        if not self.redis_url:
            raise ValueError("mlxq gateway: no Redis URL (pass --redis-url or set MLXQ_REDIS_URL)")
        self.redis: Optional[aredis.Redis] = None
        self.metrics = GatewayMetrics()
        self.token_names = TokenNames()
        self._background: set[asyncio.Task] = set()
        self.drain = DrainRate()
        # a finished job's result is read once more: allow for a link that drops just then
        self.result_wait_s = max(10.0, self.settings.redis_outage_s)
        # JSON carries a request in up to ~4x the bytes of its packed form (token ids as digits and
        # commas), so the body may be that much larger than the cap on the packed request.
        self.max_body_bytes = 4 * self.settings.max_prompt_bytes
        self._key_names: dict[str, tuple[float, str]] = {}  # sha256(key) -> (read at, name): KeyNames

    @contextlib.asynccontextmanager
    async def lifespan(self, app):
        # one server, any node of a cluster or several seeds; waits up to redis_outage_s for one to answer
        self.redis = connect_async(self.redis_url, wait_s=self.settings.redis_outage_s)
        self.subscriber = AsyncSubscriber(self.redis)  # every request's stream: one pub/sub link per node
        # one log line per link state change; a request fails (503) once Redis stayed down redis_outage_s
        self.watch = link_watch("mlxq gateway", self.redis, give_up_s=self.settings.redis_outage_s)
        await self._log_auth_mode()
        try:
            yield
        finally:
            if self._background:
                await asyncio.gather(*self._background, return_exceptions=True)
            await self.subscriber.aclose()
            await close_pins(self.redis)
            await self.redis.aclose()

    async def _log_auth_mode(self) -> None:
        """One line at start: open, keys required, or keys with anonymous callers let in (and at which tier)."""
        gk = GlobalKeys(self.settings.prefix)
        try:
            keys_exist = bool(await self.redis.exists(gk.api_keys))
            anonymous = await self.redis.hget(gk.policy, "anonymous")
        except Exception as exc:  # Redis not up yet: requests will say so
            log.warning("cannot read the API key registry at start: %s", exc)
            return
        mode = apikeys.auth_mode(keys_exist, anonymous)
        if keys_exist:
            log.info("auth: %s", mode)
        else:
            log.warning("auth: %s; `mlxq keys create --name NAME --tier TIER` makes a key and then requires keys",
                        mode)

    async def _authorized(self, request: Request, endpoint: str) -> Optional[Response]:
        """None when the caller may go on; a 401 response for an unknown or revoked key."""
        try:
            await self.client(request).tier()
        except AuthError as exc:
            return self._error(endpoint, OpenAIError(401, str(exc), "authentication_error", code="invalid_api_key"))
        return None

    KEY_NAME_TTL_S = 60.0  # a renamed or new key shows under its name within this long

    async def _key_name(self, api_key: Optional[str]) -> str:
        """The metrics label of a submitting caller's key: its name, read from the key registry's
        info once a minute per key (a request costs no extra Redis read in between)."""
        if not api_key:
            return "anonymous"
        h = apikeys.key_hash(api_key)
        now = time.monotonic()
        cached = self._key_names.get(h)
        if cached is not None and now - cached[0] < self.KEY_NAME_TTL_S:
            return cached[1]
        try:
            raw = await self.redis.hget(GlobalKeys(self.settings.prefix).api_key_info, h)
        except Exception:  # noqa: BLE001 - a label is not worth failing a request the key check passed
            return cached[1] if cached else "unnamed"
        if raw is None:  # open mode: any token is served, and it names no registered key
            name = "anonymous" if not await self.redis.exists(GlobalKeys(self.settings.prefix).api_keys) else "unnamed"
        else:
            name = apikeys.key_label(raw)
        if len(self._key_names) > 10_000:  # tokens sent in open mode are not keys: keep no unbounded map
            self._key_names.clear()
        self._key_names[h] = (now, name)
        return name

    def client(self, request: Request) -> AsyncClient:
        return AsyncClient(api_key=bearer(request), settings=self.settings, redis_client=self.redis,
                           subscriber=self.subscriber, watch=self.watch)

    def spawn(self, coro) -> None:
        """Run a coroutine outside the request's task (which may be being cancelled)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # -- endpoints -------------------------------------------------------------------------
    async def models(self, request: Request) -> Response:
        denied = await self._authorized(request, "/v1/models")
        if denied is not None:
            return denied
        models = self._live(await self.client(request).models())
        data = [{"id": name, "object": "model", "created": int(info.get("created", 0) or 0), "owned_by": "mlxq",
                 "context_length": info.get("context_length")} for name, info in sorted(models.items())]
        self.metrics.requests.labels("/v1/models", "200").inc()
        return JSONResponse({"object": "list", "data": data})

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, ChatCompletionRequest, chat=True)

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, CompletionRequest, chat=False)

    async def health(self, request: Request) -> Response:
        """Liveness: the process serves HTTP.  No key and no Redis: an orchestrator restarts a gateway
        whose /health fails, and restarting one because Redis is down cures nothing (/ready says that)."""
        return JSONResponse({"status": "ok"})

    async def ready(self, request: Request) -> Response:
        """Readiness: Redis answers within ``ready_timeout_s`` and some model has a live worker (a
        heartbeat that still vouches for it).  503 otherwise, with the reason in the body.  No key: a
        probe carries none, so the body names no model."""
        timeout = self.settings.ready_timeout_s
        try:
            models, live = await asyncio.wait_for(self._live_workers(), timeout)
        except asyncio.TimeoutError:
            return self._not_ready(f"Redis did not answer within {timeout:g}s", redis="timeout")
        except Exception as exc:  # noqa: BLE001 - whatever the link says, the answer is "not ready, why"
            return self._not_ready(f"Redis is unreachable: {type(exc).__name__}: {exc}", redis="unreachable")
        body = {"redis": "ok", "models": models, "live_workers": live}
        if not live:
            why = "no model is registered" if not models else f"no live worker for any of {models} models"
            return self._not_ready(why, **body)
        return JSONResponse({"status": "ready", **body})

    async def _live_workers(self) -> tuple[int, int]:
        """(registered models, workers whose heartbeat vouches for them now), read without retries: a
        probe wants the answer now, not one after ``redis_outage_s``.  Heartbeats are in server time
        (``beats``: worker -> the time until which its last beat vouches for it; a stuck worker's is 0)."""
        client = AsyncClient(settings=self.settings, redis_client=self.redis, subscriber=self.subscriber,
                             watch=self.watch)
        await self.redis.ping()
        gk = client.gkeys
        models = await client.at(gk.models).hkeys(gk.models)
        live = 0
        for name in models:
            beats = gk.model_keys(name.decode() if isinstance(name, bytes) else name).beats
            r = client.at(beats)
            sec, usec = await r.time()
            live += await r.zcount(beats, f"({sec + usec / 1e6}", "+inf")
        return len(models), live

    def _not_ready(self, reason: str, **fields) -> JSONResponse:
        log.debug("/ready 503: %s", reason)  # (a probe asks every few seconds: the body says why)
        return JSONResponse({"status": "not ready", "reason": reason, **fields}, status_code=503,
                            headers={"Retry-After": str(max(1, math.ceil(self.settings.ready_timeout_s)))})

    async def prometheus(self, request: Request) -> Response:
        denied = await self._authorized(request, "/metrics")
        if denied is not None:
            return denied
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def _live(self, models: dict[str, dict]) -> dict[str, dict]:
        """The registered models that a live worker serves now (heartbeat within ``live_worker_s``)."""
        return {name: info for name, info in models.items() if has_live_worker(info, self.settings.live_worker_s)}

    async def _wait_for_worker(self, client: AsyncClient, model: str, models: dict[str, dict]) -> dict[str, dict]:
        """Wait up to ``no_worker_wait_s`` for a live worker of ``model`` (one restarting comes back);
        then ``NoLiveWorker`` (503 with Retry-After).  The registry as last read."""
        deadline = time.monotonic() + self.settings.no_worker_wait_s
        while model not in self._live(models):
            if time.monotonic() >= deadline:
                raise NoLiveWorker(model, self.settings.no_worker_wait_s)
            await asyncio.sleep(min(0.25, max(0.0, deadline - time.monotonic())))
            models = await client.models()
        return models

    # -- the generation path ------------------------------------------------------------------
    async def _generate(self, request: Request, schema, chat: bool) -> Response:
        endpoint = request.url.path
        floor = "low" if endpoint.startswith("/v1/batch/") else None
        started = time.monotonic()
        try:
            client = self.client(request)
            tier = await client.tier(floor)  # 401 before anything else
            body = await _json_body(request, self.max_body_bytes)
            try:
                req = schema.model_validate(body)
            except ValidationError as exc:
                raise validation_error(exc) from None
            kwargs = req.submit_kwargs()
            models = await client.models()
            if req.model and req.model not in models:
                raise OpenAIError(404, f"model {req.model!r} is not served by any worker", param="model",
                                  code="model_not_found")
            model = req.model or await client.model
            if floor is None:  # interactive: a model no worker serves now is a 503, nothing queued
                models = await self._wait_for_worker(client, model, models)
            tools = _check_for_model(model, kwargs, models.get(model))
            if not self.token_names.loaded(models.get(model)):  # read tokenizer.json off the event loop
                await asyncio.to_thread(self.token_names.tokenizer, models.get(model))
            try:
                job = await client.submit(model=model, _floor=floor, _source="gateway",
                                          _count_tokens=self.token_names.counter(models.get(model)), **kwargs)
            except ValidationError as exc:
                raise validation_error(exc) from None
            except ContextLengthError as exc:
                raise OpenAIError(400, str(exc), param="messages" if chat else "prompt",
                                  code="context_length_exceeded") from None
        except OpenAIError as exc:
            return self._error(endpoint, exc)
        except ClientDisconnect:  # gone while its body was still coming: nothing was queued
            self.metrics.requests.labels(endpoint, "499").inc()
            return Response(status_code=499)
        except AuthError as exc:
            return self._error(endpoint, OpenAIError(401, str(exc), "authentication_error", code="invalid_api_key"))
        except OverloadError as exc:
            wait = await self._drain_wait(client, req.model or client._model, tier)
            return self._error(endpoint, OpenAIError(429, str(exc), "rate_limit_error", code="queue_full"), wait)
        except RedisUnreachable as exc:  # retried for redis_outage_s first: a dropped link alone is a pause
            return self._error(endpoint, unreachable_error(exc))
        except NoModelError as exc:
            return self._error(endpoint, OpenAIError(404, str(exc), param="model", code="model_not_found"))
        except (JobRefused, ValueError) as exc:
            return self._error(endpoint, validation_error(exc))
        jlog(logging.INFO, job.id, 0, "submitted by %s at tier %s (%s, stream=%s)", endpoint, tier, model, req.stream)
        self.metrics.key_requests.labels(await self._key_name(bearer(request))).inc()
        fmt = LogprobFormatter(self.token_names.for_model(models.get(model)), req.top_n)
        meta = _Meta(id=("chatcmpl-" if chat else "cmpl-") + job.id, model=model, created=now_s(), chat=chat,
                     endpoint=endpoint, started=started, include_usage=req.include_usage, tools=tools,
                     n=kwargs.get("n") or 1, tier=tier)
        if req.stream:
            return await self._stream(request, job, meta, fmt)
        return await self._complete(request, job, meta, fmt)

    async def _done_unless_gone(self, request: Request, task: asyncio.Future, job: AsyncJob, reason: str,
                                timeout: Optional[float] = None) -> bool:
        """Wait for ``task`` or the client's disconnect, whichever comes first, or ``timeout``; on a
        disconnect cancel the task and the job (False)."""
        gone_task = asyncio.ensure_future(_wait_disconnect(request))
        done, _ = await asyncio.wait({task, gone_task}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        if gone_task in done and task not in done:
            task.cancel()
            await self._cancel(job, reason)
            return False
        gone_task.cancel()
        return True

    async def _stream(self, request: Request, job: AsyncJob, meta: "_Meta", fmt: LogprobFormatter) -> Response:
        """Headers go out with the job's first delta, so that a job that fails before producing anything
        (refused by the worker) is answered with a plain error status; or, when the job still waits
        after ``sse_keepalive_s``, with the first keep-alive comment (a refusal is then an error event)."""
        deltas = job.stream()
        first_task = asyncio.ensure_future(deltas.__anext__())
        every = self.settings.sse_keepalive_s
        if not await self._done_unless_gone(request, first_task, job, "client disconnected before the first token",
                                            timeout=every):
            return Response(status_code=499)
        if first_task.done():
            try:
                first = first_task.result()
            except StopAsyncIteration:
                first = None
            if _refused(first):
                await deltas.aclose()  # its channel unsubscribed now, not when the generator is collected
                res = await job.result(timeout=self.result_wait_s)
                jlog(logging.INFO, job.id, res.stats.attempts, "failed before streaming: %s", res.error)
                return self._error(meta.endpoint, job_error(res))
        else:
            jlog(logging.INFO, job.id, 0, "waiting in the queue: SSE keep-alive every %gs", every)
        return StreamingResponse(self._sse(job, meta, fmt, _from_first(first_task, deltas, every)),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def _complete(self, request: Request, job: AsyncJob, meta: "_Meta", fmt: LogprobFormatter) -> Response:
        self.metrics.inflight.inc()
        try:
            result_task = asyncio.ensure_future(job.result())
            if not await self._done_unless_gone(request, result_task, job, "client disconnected"):
                return Response(status_code=499)
            res = result_task.result()
        finally:
            self.metrics.inflight.dec()
        jlog(logging.INFO, job.id, res.stats.attempts, "finished: %s, %d tokens", res.finish_reason,
             res.stats.generated_tokens)
        failed = failed_output(res)
        if failed is not None:
            return self._error(meta.endpoint, job_error(failed))
        self.metrics.tokens.inc(res.stats.generated_tokens)
        self.metrics.latency.labels(meta.endpoint, meta.tier).observe(time.monotonic() - meta.started)
        self.metrics.requests.labels(meta.endpoint, "200").inc()
        obj = "chat.completion" if meta.chat else "text_completion"
        return JSONResponse({"id": meta.id, "object": obj, "created": meta.created, "model": meta.model,
                             "choices": [choice(meta.chat, out, fmt) for out in res.outputs], "usage": usage(res),
                             "system_fingerprint": None, "stats": job_stats(res)})

    async def _sse(self, job: AsyncJob, meta: "_Meta", fmt: LogprobFormatter,
                   deltas: AsyncIterator[Delta | str]) -> AsyncIterator[str]:
        """The job's deltas as OpenAI's SSE events; a ``str`` among them (a keep-alive comment) goes out as is."""
        self.metrics.inflight.inc()
        finished, attempt, first = False, 0, True
        # per choice (a job's sample): its chat deltas and its text offset
        chats = [ChatDeltas() for _ in range(meta.n)]
        offsets = [0] * meta.n
        ended: set[int] = set()
        try:
            if meta.chat:  # content null first when the answer may be calls only, as OpenAI streams them
                for i in range(meta.n):
                    yield _event(meta.chunk({"role": "assistant", "content": None if meta.tools else ""}, None,
                                            index=i))
            async for d in deltas:
                if isinstance(d, str):
                    self.metrics.keepalives.inc()
                    yield d
                    continue
                attempt = max(attempt, d.attempt)
                i = d.sample or 0
                if first and d.text:
                    first = False
                    self.metrics.ttft.labels(meta.endpoint, meta.tier).observe(time.monotonic() - meta.started)
                if d.finish_reason == "error":
                    finished = True
                    if _refused(d):  # refused after the keep-alives sent the headers: its 400 as an event,
                        # the stream's end (no [DONE]), as OpenAI ends a stream that failed
                        res = await job.result(timeout=self.result_wait_s)
                        jlog(logging.INFO, job.id, res.stats.attempts, "refused while streaming: %s", res.error)
                        err = job_error(res)
                        self.metrics.errors.labels(err.type).inc()
                        yield _event(err.body())
                        return
                    yield _event(OpenAIError(500, d.error or "generation failed", "server_error",
                                             code="job_failed").body())
                    if d.sample is not None and len(ended) + 1 < meta.n:
                        # one sample of several failed: the stream ends with its error, so the samples
                        # still running would run for nobody
                        self.spawn(self._cancel(job, f"sample {i} failed, which ended the stream", attempt))
                    break
                delta = chats[i].delta(d) if meta.chat else d.text
                if meta.chat and delta and d.finish_reason:  # as OpenAI: the finish in a chunk of its own
                    yield _event(self._delta_chunk(meta, d.model_copy(update={"finish_reason": None}), delta,
                                                   fmt, offsets[i]))
                    d, delta = d.model_copy(update={"logprobs": None}), {}
                if delta or d.logprobs or d.finish_reason:
                    yield _event(self._delta_chunk(meta, d, delta, fmt, offsets[i]))
                offsets[i] += len(d.text)
                if d.finish_reason:
                    ended.add(i)
                    finished = d.sample is None or len(ended) == meta.n
            if meta.include_usage and finished:
                res = await job.result(timeout=self.result_wait_s)
                yield _event(meta.usage_chunk(usage(res), job_stats(res)))
        except Exception as exc:  # noqa: BLE001 - the headers went out: a 500 now is an ASGI error
            # the stream cannot go on (Redis unreachable past redis_outage_s, a job lost for good):
            # it ends as OpenAI ends one, with an error event and no [DONE]; one log line
            jlog(logging.WARNING, job.id, attempt, "stream ended early: %s: %s", type(exc).__name__, exc)
            err = (unreachable_error(exc) if isinstance(exc, RedisUnreachable) else
                   OpenAIError(500, f"the stream was interrupted: {type(exc).__name__}: {exc}", "server_error",
                               code="stream_interrupted"))
            self.metrics.errors.labels(err.type).inc()
            yield _event(err.body())
        else:
            yield "data: [DONE]\n\n"
            if finished:  # its tokens and log line, off the response: it ends at [DONE], not a read later
                self.spawn(self._streamed(job))
            self.metrics.requests.labels(meta.endpoint, "200").inc()
            self.metrics.latency.labels(meta.endpoint, meta.tier).observe(time.monotonic() - meta.started)
        finally:
            self.metrics.inflight.dec()
            # the job's stream ends here however this one does (a sample's error breaks out of it):
            # its channel is unsubscribed now, not whenever the generator is collected
            with contextlib.suppress(Exception):
                await deltas.aclose()
            if not finished:  # the client went away (the request task is being cancelled)
                self.spawn(self._cancel(job, "client disconnected from the stream", attempt))

    async def _streamed(self, job: AsyncJob) -> None:
        """A streamed job's result, for the token counter and the log (its stream has ended)."""
        try:
            res = await job.result(timeout=self.result_wait_s)
        except Exception as exc:  # the response went out whole; only the accounting misses it
            jlog(logging.WARNING, job.id, 0, "streamed; its result could not be read: %s", exc)
            return
        self.metrics.tokens.inc(res.stats.generated_tokens)
        jlog(logging.INFO, job.id, res.stats.attempts, "streamed: %s, %d tokens", res.finish_reason,
             res.stats.generated_tokens)

    def _delta_chunk(self, meta: "_Meta", d: Delta, delta, fmt: LogprobFormatter, offset: int) -> dict:
        """``delta``: the chunk's chat delta (``ChatDeltas``), or a completion's text."""
        reason, i = d.finish_reason, d.sample or 0
        if meta.chat:
            lp = fmt.chat(d.logprobs) if d.logprobs else None
            return meta.chunk(delta, reason, lp, index=i)
        return meta.chunk(delta, reason, fmt.completion(d.logprobs, offset) if d.logprobs else None, index=i)

    async def _cancel(self, job: AsyncJob, why: str, attempt: int = 0) -> None:
        try:
            status = await job.cancel()
        except Exception as exc:
            jlog(logging.WARNING, job.id, attempt, "cancel after disconnect failed: %s", exc)
            return
        self.metrics.cancels.inc()
        jlog(logging.INFO, job.id, attempt, "%s: cancel -> %s", why, status)
        with contextlib.suppress(Exception):
            await job.result(timeout=self.result_wait_s)  # the final status; also releases its channel

    def _error(self, endpoint: str, exc: OpenAIError, retry_after: Optional[float] = None) -> JSONResponse:
        """An error response; every 429 and 503 says when to come back (``Retry-After``, seconds)."""
        self.metrics.requests.labels(endpoint, str(exc.status)).inc()
        self.metrics.errors.labels(exc.type).inc()
        log.info("%s %d %s: %s", endpoint, exc.status, exc.type, exc.message)
        headers = getattr(exc, "headers", None)  # an error that knows its own Retry-After
        if headers is None and exc.status in (429, 503):
            wait = retry_after if retry_after is not None else RETRY_AFTER_DEFAULT_S
            headers = {"Retry-After": str(max(1, math.ceil(wait)))}
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    async def _drain_wait(self, client: AsyncClient, model: Optional[str], tier: str) -> Optional[float]:
        """Seconds until the tier's queue has drained at the rate jobs have been finishing lately
        (None: no estimate yet)."""
        if not model:
            return None
        try:
            key = client.gkeys.model_keys(model).counts
            counts = await client.at(key).hgetall(key)
        except LINK_ERRORS:
            return None
        counts = {k.decode(): int(v) for k, v in counts.items()}
        return self.drain.wait(model, counts.get("processed", counts.get("done", 0)),
                               counts.get(f"queued:{tier}", 0))

    async def unreachable(self, request: Request, exc: RedisUnreachable) -> Response:
        """Any endpoint, when Redis stayed unreachable past ``redis_outage_s``: 503 + Retry-After."""
        return self._error(request.url.path, unreachable_error(exc))

    async def http_error(self, request: Request, exc: HTTPException) -> Response:
        """A path no route serves (404) or a method it does not take (405), in OpenAI's error shape
        (Starlette's own answer is plain text, which OpenAI clients cannot read as an error)."""
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        err = OpenAIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", param=None, code=code)
        # a 404's path is whatever was asked for: one metrics label for all of them
        response = self._error("(no route)" if exc.status_code == 404 else request.url.path, err)
        response.headers.update(exc.headers or {})
        return response

    async def internal_error(self, request: Request, exc: Exception) -> Response:
        """What no handler caught: a 500 in OpenAI's error shape (Starlette logs the traceback)."""
        return self._error(request.url.path, OpenAIError(500, f"internal error: {type(exc).__name__}",
                                                         "server_error", code="internal_error"))


class NoLiveWorker(OpenAIError):
    """503: the model is registered but no worker of it is alive now (nothing was queued)."""

    def __init__(self, model: str, waited_s: float):
        super().__init__(503, f"no live worker for model {model!r} (waited {waited_s:g}s; nothing was queued): "
                              "retry later, or use /v1/batch/ to queue it until a worker starts",
                         "server_error", param="model", code="no_live_worker")
        self.headers = {"Retry-After": str(max(1, math.ceil(waited_s)))}


class _Meta:
    def __init__(self, *, id: str, model: str, created: int, chat: bool, endpoint: str, started: float,
                 include_usage: bool, tools: bool = False, n: int = 1, tier: str = "normal"):
        self.id, self.model, self.created, self.chat = id, model, created, chat
        self.tier = tier  # the job's tier: a label of the latency histograms
        self.endpoint, self.started, self.include_usage = endpoint, started, include_usage
        self.tools = tools  # the job may answer with tool calls
        self.n = n  # choices (the job's samples)

    def chunk(self, delta, reason: Optional[str], logprobs: Optional[dict] = None, index: int = 0) -> dict:
        """A chunk of choice ``index`` (the job's sample); ``reason``: mlxq's finish reason."""
        if self.chat:
            choice = {"index": index, "delta": delta, "logprobs": logprobs, **finish_fields(reason)}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": index, "text": delta, "logprobs": logprobs, **finish_fields(reason)}
            obj = "text_completion"
        out = {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": [choice]}
        if self.include_usage:
            out["usage"] = None
        return out

    def usage_chunk(self, u: dict, stats: dict) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": [],
                "usage": u, "stats": stats}


RETRY_AFTER_DEFAULT_S = 2.0  # a 429/503 with no better estimate


def unreachable_error(exc: Exception) -> OpenAIError:
    return OpenAIError(503, f"Redis is unreachable: {exc}", "server_error", code="redis_unavailable")


class DrainRate:
    """How fast each model's jobs finish, from the ``processed`` counter seen at refusals over a
    sliding minute; ``wait`` is how long the waiting jobs take at that rate, in [1, 60] s."""

    WINDOW_S = 60.0

    def __init__(self):
        self._seen: dict[str, list[tuple[float, int]]] = {}

    def wait(self, model: str, processed: int, queued: int) -> Optional[float]:
        now = time.monotonic()
        seen = [(t, n) for t, n in self._seen.get(model, []) if now - t <= self.WINDOW_S]
        seen.append((now, processed))
        self._seen[model] = seen
        (t0, n0), span = seen[0], now - seen[0][0]
        if span < 1.0 or processed <= n0:
            return None
        rate = (processed - n0) / span
        return min(60.0, max(1.0, queued / rate))


def _check_for_model(model: str, kwargs: dict, info: Optional[dict]) -> bool:
    """What only the model's own info can refuse before queueing: ``logit_bias`` ids outside its
    vocabulary, a required or named ``tool_choice`` its tool-call format cannot enforce.  True when
    the job may answer with tool calls."""
    check_bias_vocab(kwargs, info)
    if not kwargs.get("tools"):
        return False
    req = GenerateRequest.model_validate({"model": model, **kwargs})  # a ValidationError is a 400
    fmt = format_from_info(info)
    if fmt is not None:
        check_format(req, fmt)  # a ToolError (ValueError) is a 400
    return uses_tools(req)


def job_error(res) -> OpenAIError:
    """A failed job (a Result, or the SampleOutput of its sample that failed) as an HTTP error: 400
    when the request can never run, else 500."""
    if res.error_code == INVALID_REQUEST:
        return OpenAIError(400, res.error or "invalid request", code="invalid_request")
    return OpenAIError(500, res.error or "generation failed", "server_error", code="job_failed")


def job_stats(res: Result) -> dict:
    """mlxq's per-job stats (queue wait, ttft, tokens/s, tier, worker, attempts), an extra field
    next to ``usage`` that OpenAI clients keep (``response.model_extra["stats"]``)."""
    return res.stats.model_dump()


KEEPALIVE = ": keep-alive\n\n"  # an SSE comment: clients ignore it, proxies see bytes flow


def _refused(d: Optional[Delta]) -> bool:
    """The job's first delta says the worker refused it (not one sample of several failing)."""
    return (d is not None and d.finish_reason == "error" and not d.text and not d.token_ids
            and d.sample is None)


async def _from_first(first: asyncio.Future, rest, every: float) -> AsyncIterator[Delta | str]:
    """The result of ``first`` (the job's first delta; ``StopAsyncIteration``: none), with
    ``KEEPALIVE`` every ``every`` seconds while it is pending, then ``rest`` (an async generator),
    which is closed when this one is: an ``async for`` left early does not close the generator it reads."""
    try:
        while not first.done():  # (the caller waited ``every`` already: a comment is due)
            yield KEEPALIVE
            await asyncio.wait({first}, timeout=every)
        try:
            yield first.result()
        except StopAsyncIteration:
            return
        async for d in rest:
            yield d
    finally:
        first.cancel()
        await rest.aclose()


def _event(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def bearer(request: Request) -> Optional[str]:
    auth = request.headers.get("authorization", "")
    scheme, _, token = auth.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return None


async def _json_body(request: Request, limit: int) -> dict:
    """The body as a JSON object, read no further than ``limit`` bytes (413 past it)."""
    too_large = OpenAIError(413, f"the request body is over {limit} bytes", code="request_too_large")
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    try:
        body = json.loads(b"".join(chunks))
    except (ValueError, UnicodeDecodeError):
        raise OpenAIError(400, "the request body is not valid JSON", code="invalid_json") from None
    except RecursionError:
        raise OpenAIError(400, "the request body is nested too deeply", code="invalid_json") from None
    if not isinstance(body, dict):
        raise OpenAIError(400, "the request body must be a JSON object", code="invalid_json")
    return body


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def create_app(redis_url: Optional[str] = None, settings: Optional[Settings] = None) -> Starlette:
    gw = Gateway(redis_url, settings)
    routes = [
        Route("/v1/models", gw.models, methods=["GET"]),
        Route("/v1/chat/completions", gw.chat, methods=["POST"]),
        Route("/v1/completions", gw.completions, methods=["POST"]),
        Route("/v1/batch/chat/completions", gw.chat, methods=["POST"]),
        Route("/v1/batch/completions", gw.completions, methods=["POST"]),
        Route("/metrics", gw.prometheus, methods=["GET"]),
        Route("/health", gw.health, methods=["GET"]),
        Route("/ready", gw.ready, methods=["GET"]),
    ]
    handlers = {RedisUnreachable: gw.unreachable, HTTPException: gw.http_error, Exception: gw.internal_error}
    app = Starlette(routes=routes, lifespan=gw.lifespan, exception_handlers=handlers)
    app.state.gateway = gw
    return app


class ServerThread:
    """Uvicorn serving an app on a thread (tests, notebooks): ``with ServerThread(app) as url: ...``."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0):
        import uvicorn

        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, name="gateway", daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        end = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > end or not self.thread.is_alive():
                raise RuntimeError("the gateway did not start")
            time.sleep(0.02)
        host, port = self.server.servers[0].sockets[0].getsockname()[:2]
        return f"http://{host}:{port}"

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
