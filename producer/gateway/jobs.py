"""What every API room of the gateway does with a request's job, written once.

- **Admission** (``Jobs.submit``): the named model or the default, a live worker (an interactive
  request waits ``no_worker_wait_s`` for one, then 503 with nothing queued), what only the model's
  own info can refuse, then the queue job through ``AsyncClient.submit``.
- **Refusals** (``Jobs.api_error``): the client core's errors as one ``OpenAIError`` each (status,
  type, code, param); a room renders it in its own API's shape.
- **The first delta** (``Jobs.first``): a stream's headers wait for it, so that a job the worker
  refuses is a plain 4xx; past ``sse_keepalive_s`` the headers go out with keep-alive comments.
- **The client's disconnect** cancels the job (``done_unless_gone``, ``cancel``), and a streamed
  job's tokens are counted after its response ended (``streamed``).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import math
import time
from typing import Any, AsyncIterator, Callable, NamedTuple, Optional

from pydantic import ValidationError
from starlette.requests import ClientDisconnect, Request

from ...shared.apikeys import AuthError
from ...shared.connection import LINK_ERRORS, RedisUnreachable
from ...shared.protocol import JobRefused, OverloadError, QuotaExceeded
from ...shared.schemas import INVALID_REQUEST, Delta, GenerateRequest, Result
from ...shared.tools import check_format, format_from_info, uses_tools
from ..aclient import AsyncClient, AsyncJob
from ..errors import ContextLengthError, NoModelError
from ..registry import has_live_worker
from ..openai_api import OpenAIError, check_bias_vocab, validation_error

log = logging.getLogger("mlxq.gateway")

KEEPALIVE = ": keep-alive\n\n"  # an SSE comment: clients ignore it, proxies see bytes flow
RETRY_AFTER_DEFAULT_S = 2.0  # a 429/503 with no better estimate


def jlog(level: int, job_id: str, attempt: int, msg: str, *args: Any) -> None:
    """A log line about a job: ``job=<id> attempt=<n>`` first, and as record fields for JSON logs."""
    log.log(level, "job=%s attempt=%d " + msg, job_id, attempt, *args, extra={"job": job_id, "attempt": attempt})


class Submitted(NamedTuple):
    job: AsyncJob
    model: str
    info: Optional[dict]  # the model's registry entry (tokenizer, context length, tool-call format)
    tools: bool  # the job may answer with tool calls


class Admitted(NamedTuple):
    req: Any  # the room's parsed request
    sub: Any  # its Submitted job (what ``queue`` returned, for a request of several jobs)
    tier: str
    client: AsyncClient


class Refusal(NamedTuple):
    """Why a request was not queued: its error (and Retry-After), or ``gone``: the client left while
    its body was still coming."""
    error: Optional[OpenAIError] = None
    retry_after: Optional[float] = None
    gone: bool = False


class First(NamedTuple):
    """How a job's first delta came: ``deltas`` to stream (keep-alives first while it waits), or the
    job's ``failed`` result (the worker refused it), or ``gone`` (the client left; the job is cancelled)."""
    deltas: Optional[AsyncIterator[Delta | str]] = None
    failed: Optional[Result] = None
    gone: bool = False


class Jobs:
    def __init__(self, gw):
        self.gw = gw
        self.drain = DrainRate()

    async def admit(self, request: Request, parse: Callable[[dict], Any], plan: Callable, *,
                    floor: Optional[str] = None, prompt_param: str, queue: Optional[Callable] = None
                    ) -> Admitted | Refusal:
        """A room's request, from its key to its queued job: the tier (a 401 before anything else),
        the body, ``parse(body)`` (the room's request model), ``plan(req, client)`` (awaited if it is a
        coroutine: the ``AsyncClient.submit`` kwargs and ``submit``'s options), then ``submit``, or
        ``queue(request, client, tier, floor, planned)`` for a room whose request is several jobs;
        or the refusal (nothing was queued)."""
        client = self.gw.client(request)
        req = tier = None
        try:
            tier = await client.tier(floor)
            req = parse(await json_body(request, self.gw.max_body_bytes))
            planned = plan(req, client)
            planned = await planned if inspect.isawaitable(planned) else planned
            if queue is not None:
                sub = await queue(request, client, tier, floor, planned)
            else:
                kwargs, options = planned
                sub = await self.submit(request, client, tier=tier, floor=floor, model=req.model, kwargs=kwargs,
                                        prompt_param=prompt_param, **options)
        except ClientDisconnect:
            return Refusal(gone=True)
        except Exception as exc:  # noqa: BLE001 - api_error re-raises what is not a refusal
            return Refusal(*await self.api_error(exc, client, req and req.model, tier))
        return Admitted(req, sub, tier, client)

    def watch(self, deltas: AsyncIterator[Delta | str], endpoint: str, tier: str,
              started: Optional[float]) -> AsyncIterator[Delta | str]:
        """``deltas`` as they come, keep-alives counted and the first token's time observed (from
        ``started``; None: not this stream's to observe, as a resumed one)."""
        return _watched(self.gw.metrics, deltas, endpoint, tier, started)

    async def submit(self, request: Request, client: AsyncClient, *, tier: str, floor: Optional[str],
                     model: Optional[str], kwargs: dict, prompt_param: str, stream: bool,
                     subscribe: bool = True, queue_anyway: bool = False) -> Submitted:
        """Queue ``kwargs`` (``AsyncClient.submit``'s) as a job of ``model`` (None: the default);
        ``subscribe=False`` for a job this request will not read (its channel is not left subscribed);
        ``queue_anyway``: an interactive job that nobody waits on now is queued with no live worker too."""
        gw = self.gw
        models = await client.models()
        if model and model not in models:
            raise OpenAIError(404, f"model {model!r} is not served by any worker", param="model",
                              code="model_not_found")
        model = model or await client.model
        if floor is None and not queue_anyway:  # interactive: no live worker now is a 503, nothing queued
            models = await self._wait_for_worker(client, model, models)
        info = models.get(model)
        tools = check_for_model(model, kwargs, info)
        if not gw.token_names.loaded(info):  # read tokenizer.json off the event loop
            await asyncio.to_thread(gw.token_names.tokenizer, info)
        try:
            job = await client.submit(model=model, _floor=floor, _source="gateway", subscribe=subscribe,
                                      _count_tokens=gw.token_names.counter(info), **kwargs)
        except ContextLengthError as exc:
            raise OpenAIError(400, str(exc), param=prompt_param, code="context_length_exceeded") from None
        jlog(logging.INFO, job.id, 0, "submitted by %s at tier %s (%s, stream=%s)", request.url.path, tier, model, stream)
        gw.metrics.key_requests.labels(await gw.key_name(bearer(request))).inc()
        return Submitted(job, model, info, tools)

    async def api_error(self, exc: Exception, client: AsyncClient, model: Optional[str],
                        tier: Optional[str]) -> tuple[OpenAIError, Optional[float]]:
        """``exc`` (raised before the job was queued) as (the error, its Retry-After); re-raises what is
        not a refusal (a bug: the app's 500)."""
        if isinstance(exc, OpenAIError):
            return exc, None
        if isinstance(exc, AuthError):
            return OpenAIError(401, str(exc), "authentication_error", code="invalid_api_key"), None
        if isinstance(exc, OverloadError):
            wait = await self._drain_wait(client, model or client._model, tier or "normal")
            return OpenAIError(429, str(exc), "rate_limit_error", code="queue_full"), wait
        if isinstance(exc, QuotaExceeded):  # OpenAI's shape for a used-up quota; again at the next day
            return OpenAIError(429, str(exc), "insufficient_quota", code="insufficient_quota"), exc.retry_after_s
        if isinstance(exc, RedisUnreachable):  # retried for redis_outage_s first: a dropped link alone is a pause
            return unreachable_error(exc), None
        if isinstance(exc, NoModelError):
            return OpenAIError(404, str(exc), param="model", code="model_not_found"), None
        if isinstance(exc, (ValidationError, JobRefused, ValueError)):
            return validation_error(exc), None
        raise exc

    async def first(self, request: Request, job: AsyncJob) -> First:
        """Wait for the job's first delta, up to ``sse_keepalive_s`` (then the stream starts with
        keep-alives), or the client's disconnect."""
        deltas = job.stream()
        first_task = asyncio.ensure_future(deltas.__anext__())
        every = self.gw.settings.sse_keepalive_s
        if not await self.done_unless_gone(request, first_task, job, "client disconnected before the first token",
                                           timeout=every):
            return First(gone=True)
        if first_task.done():
            try:
                first = first_task.result()
            except StopAsyncIteration:
                first = None
            if refused(first):
                await deltas.aclose()  # its channel unsubscribed now, not when the generator is collected
                res = await job.result(timeout=self.gw.result_wait_s)
                jlog(logging.INFO, job.id, res.stats.attempts, "failed before streaming: %s", res.error)
                return First(failed=res)
        else:
            jlog(logging.INFO, job.id, 0, "waiting in the queue: SSE keep-alive every %gs", every)
        return First(deltas=from_first(first_task, deltas, every))

    async def done_unless_gone(self, request: Request, task: asyncio.Future, job: AsyncJob, reason: str,
                               timeout: Optional[float] = None) -> bool:
        """Wait for ``task`` or the client's disconnect, whichever comes first, or ``timeout``; on a
        disconnect cancel the task and the job (False)."""
        gone_task = asyncio.ensure_future(wait_disconnect(request))
        done, _ = await asyncio.wait({task, gone_task}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        if gone_task in done and task not in done:
            task.cancel()
            await self.cancel(job, reason)
            return False
        gone_task.cancel()
        return True

    async def result_unless_gone(self, request: Request, job: AsyncJob) -> Optional[Result]:
        """The job's result, or None when the client left first (the job is cancelled)."""
        self.gw.metrics.inflight.inc()
        try:
            result_task = asyncio.ensure_future(job.result())
            if not await self.done_unless_gone(request, result_task, job, "client disconnected"):
                return None
            res = result_task.result()
        finally:
            self.gw.metrics.inflight.dec()
        jlog(logging.INFO, job.id, res.stats.attempts, "finished: %s, %d tokens", res.finish_reason,
             res.stats.generated_tokens)
        return res

    async def cancel(self, job: AsyncJob, why: str, attempt: int = 0) -> None:
        try:
            status = await job.cancel()
        except Exception as exc:
            jlog(logging.WARNING, job.id, attempt, "cancel after disconnect failed: %s", exc)
            return
        self.gw.metrics.cancels.inc()
        jlog(logging.INFO, job.id, attempt, "%s: cancel -> %s", why, status)
        with contextlib.suppress(Exception):
            await job.result(timeout=self.gw.result_wait_s)  # the final status; also releases its channel

    async def streamed(self, job: AsyncJob) -> None:
        """A streamed job's result, for the token counter and the log (its stream has ended)."""
        try:
            res = await job.result(timeout=self.gw.result_wait_s)
        except Exception as exc:  # the response went out whole; only the accounting misses it
            jlog(logging.WARNING, job.id, 0, "streamed; its result could not be read: %s", exc)
            return
        self.gw.metrics.tokens.inc(res.stats.generated_tokens)
        jlog(logging.INFO, job.id, res.stats.attempts, "streamed: %s, %d tokens", res.finish_reason,
             res.stats.generated_tokens)

    async def _wait_for_worker(self, client: AsyncClient, model: str, models: dict[str, dict]) -> dict[str, dict]:
        """Wait up to ``no_worker_wait_s`` for a live worker of ``model`` (one restarting comes back);
        then ``NoLiveWorker`` (503 with Retry-After).  The registry as last read."""
        settings = self.gw.settings
        deadline = time.monotonic() + settings.no_worker_wait_s
        while model not in live_models(models, settings.live_worker_s):
            if time.monotonic() >= deadline:
                raise NoLiveWorker(model, settings.no_worker_wait_s)
            await asyncio.sleep(min(0.25, max(0.0, deadline - time.monotonic())))
            models = await client.models()
        return models

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


async def _watched(metrics, deltas, endpoint: str, tier: str, started: Optional[float]):
    async for d in deltas:
        if isinstance(d, str):
            metrics.keepalives.inc()
        elif started is not None and (d.text or d.reasoning):
            metrics.first_token(endpoint, tier, time.monotonic() - started)
            started = None
        yield d


def live_models(models: dict[str, dict], live_worker_s: float) -> dict[str, dict]:
    """The registered models that a live worker serves now (heartbeat within ``live_worker_s``)."""
    return {name: info for name, info in models.items() if has_live_worker(info, live_worker_s)}


class NoLiveWorker(OpenAIError):
    """503: the model is registered but no worker of it is alive now (nothing was queued)."""

    def __init__(self, model: str, waited_s: float):
        super().__init__(503, f"no live worker for model {model!r} (waited {waited_s:g}s; nothing was queued): "
                              "retry later, or use /v1/batch/ to queue it until a worker starts",
                         "server_error", param="model", code="no_live_worker")
        self.headers = {"Retry-After": str(max(1, math.ceil(waited_s)))}


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
        (_, n0), span = seen[0], now - seen[0][0]
        if span < 1.0 or processed <= n0:
            return None
        rate = (processed - n0) / span
        return min(60.0, max(1.0, queued / rate))


def check_for_model(model: str, kwargs: dict, info: Optional[dict]) -> bool:
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


def stream_error(exc: Exception) -> OpenAIError:
    """Why a stream whose headers went out could not go on (Redis unreachable past
    ``redis_outage_s``, a job lost for good)."""
    if isinstance(exc, RedisUnreachable):
        return unreachable_error(exc)
    return OpenAIError(500, f"the stream was interrupted: {type(exc).__name__}: {exc}", "server_error",
                       code="stream_interrupted")


def refused(d: Optional[Delta]) -> bool:
    """The job's first delta says the worker refused it (not one sample of several failing)."""
    return (d is not None and d.finish_reason == "error" and not d.text and not d.token_ids
            and d.sample is None)


async def from_first(first: asyncio.Future, rest, every: float) -> AsyncIterator[Delta | str]:
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


def sse_data(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def bearer(request: Request) -> Optional[str]:
    """The caller's API key: ``Authorization: Bearer <key>`` (OpenAI's clients) or ``x-api-key: <key>``
    (Anthropic's); the same keys and tiers either way."""
    auth = request.headers.get("authorization", "")
    scheme, _, token = auth.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return request.headers.get("x-api-key", "").strip() or None


async def read_body(request: Request, limit: int) -> bytes:
    """The body, read no further than ``limit`` bytes (413 past it)."""
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
    return b"".join(chunks)


async def json_body(request: Request, limit: int) -> dict:
    """The body as a JSON object, read no further than ``limit`` bytes (413 past it)."""
    raw = await read_body(request, limit)
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise OpenAIError(400, "the request body is not valid JSON", code="invalid_json") from None
    except RecursionError:
        raise OpenAIError(400, "the request body is nested too deeply", code="invalid_json") from None
    if not isinstance(body, dict):
        raise OpenAIError(400, "the request body must be a JSON object", code="invalid_json")
    return body


async def wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
