"""Anthropic's Messages API, as queue jobs.

    POST /v1/messages                 (a message is one job; stream or not)
    POST /v1/messages/count_tokens    (the prompt's tokens as the worker renders it)

The key comes as ``x-api-key`` (Anthropic's clients) or ``Authorization: Bearer``: the same keys and
tiers as the OpenAI rooms.  Errors are Anthropic's shape, the app's own (404, 405, 500) too, under
these paths.  A stream is Anthropic's events: ``message_start``, a content block per thought, text
and call (``content_block_start``/``_delta``/``_stop``), ``message_delta`` with the stop reason and
usage, ``message_stop``; ``ping`` while the job waits for its first token; a refusal after the
headers went out is an ``error`` event.  A client that disconnects cancels its job.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from typing import AsyncIterator, Callable, Optional

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ...shared.schemas import Delta
from ..anthropic_api import (BlockEvents, MessagesRequest, PromptRequest, content_blocks, error_body, stop_fields,
                             usage)
from ..openai_api import ChatDeltas, OpenAIError, failed_output
from .chat_completions import SSE_HEADERS
from .jobs import Admitted, Refusal, Submitted, job_error, jlog, refused, stream_error

PATH = "/v1/messages"
PING = 'event: ping\ndata: {"type":"ping"}\n\n'


def sse_event(event: str, data: dict) -> str:
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


class Messages:
    def __init__(self, gw):
        self.gw = gw
        self.jobs = gw.jobs

    def routes(self) -> list[Route]:
        return [Route(PATH, self.create, methods=["POST"]),
                Route(f"{PATH}/count_tokens", self.count_tokens, methods=["POST"])]

    @staticmethod
    def error_shape(path: str) -> Optional[Callable[[OpenAIError], dict]]:
        """Anthropic's error body for the paths of this room (the app's 404, 405 and 500 there too)."""
        return error_body if path == PATH or path.startswith(PATH + "/") else None

    def error(self, exc: OpenAIError, retry_after: Optional[float] = None, endpoint: str = PATH) -> Response:
        return self.gw.error(endpoint, exc, retry_after, shape=error_body)

    async def _admit(self, request: Request, endpoint: str, schema, kwargs_of) -> "Admitted | Response":
        """The request (``schema``) queued as a job of ``kwargs_of(request)``, or the error response
        (nothing was queued)."""
        got = await self.jobs.admit(request, schema.model_validate,
                                    lambda req, _: (kwargs_of(req), {"stream": bool(getattr(req, "stream", False))}),
                                    prompt_param="messages")
        return self.gw.refused(endpoint, got, shape=error_body) if isinstance(got, Refusal) else got

    async def create(self, request: Request) -> Response:
        started = time.monotonic()
        got = await self._admit(request, PATH, MessagesRequest, MessagesRequest.submit_kwargs)
        if isinstance(got, Response):
            return got
        answer = _Answer(got.sub, got.req.max_tokens, got.tier, started)
        if got.req.stream:
            return await self._stream(request, answer)
        res = await self.jobs.result_unless_gone(request, answer.job)
        if res is None:
            return Response(status_code=499)
        failed = failed_output(res)
        if failed is not None:
            return self.error(job_error(failed))
        self.gw.metrics.served(PATH, answer.tier, started, res.stats.generated_tokens)
        return JSONResponse({**answer.head(), "content": content_blocks(res),
                             **stop_fields(res, got.req.max_tokens), "usage": usage(res)})

    async def count_tokens(self, request: Request) -> Response:
        """The prompt's tokens, counted by the worker that renders it (chat template, tools and all):
        a one-token job, its generated token thrown away.  Exact where a count at the gateway could
        not be: only the worker has the template (and mlxq's tool prompt for a template without
        a tool slot); the prefill it costs leaves the prompt in the prefix cache for the message."""
        endpoint = f"{PATH}/count_tokens"
        got = await self._admit(request, endpoint, PromptRequest,
                                 lambda r: {**r.prompt_kwargs(), "max_tokens": 1, "temperature": 0.0})
        if isinstance(got, Response):
            return got
        res = await self.jobs.result_unless_gone(request, got.sub.job)
        if res is None:
            return Response(status_code=499)
        if res.finish_reason == "error":
            return self.error(job_error(res), endpoint=endpoint)
        self.gw.metrics.requests.labels(endpoint, "200").inc()
        return JSONResponse({"input_tokens": res.stats.prompt_tokens})

    async def _stream(self, request: Request, answer: "_Answer") -> Response:
        first = await self.jobs.first(request, answer.job)
        if first.gone:
            return Response(status_code=499)
        if first.failed is not None:
            return self.error(job_error(first.failed))
        return StreamingResponse(self._sse(answer, first.deltas), media_type="text/event-stream", headers=SSE_HEADERS)

    async def _sse(self, answer: "_Answer", deltas: AsyncIterator[Delta | str]) -> AsyncIterator[str]:
        """The job's deltas as Anthropic's events; a keep-alive (a ``str`` among them) as a ``ping``."""
        gw, metrics, job = self.gw, self.gw.metrics, answer.job
        metrics.inflight.inc()
        finished, attempt = False, 0
        chat, blocks = ChatDeltas(), BlockEvents()
        try:
            yield sse_event("message_start", {"type": "message_start", "message": {
                **answer.head(), "content": [], "stop_reason": None, "stop_sequence": None,
                # the prompt's count comes with the result: message_delta carries it
                "usage": {"input_tokens": 0, "output_tokens": 0}}})
            async for d in self.jobs.watch(deltas, PATH, answer.tier, answer.started):
                if isinstance(d, str):
                    yield PING
                    continue
                attempt = max(attempt, d.attempt)
                if d.finish_reason == "error":  # refused after a ping sent the headers (its 400), or failed
                    finished = True
                    res = await job.result(timeout=gw.result_wait_s)
                    jlog(logging.INFO, job.id, res.stats.attempts, "%s while streaming: %s",
                         "refused" if refused(d) else "failed", res.error)
                    err = job_error(res)
                    metrics.errors.labels(err.type).inc()
                    yield sse_event("error", error_body(err))
                    return
                for event, data in blocks.events(chat.delta(d)):
                    yield sse_event(event, data)
                if d.finish_reason:
                    finished = True
            for event, data in blocks.close():
                yield sse_event(event, data)
            if finished:
                res = await job.result(timeout=gw.result_wait_s)
                yield sse_event("message_delta", {"type": "message_delta",
                                                  "delta": stop_fields(res, answer.max_tokens), "usage": usage(res)})
                metrics.tokens.inc(res.stats.generated_tokens)
                jlog(logging.INFO, job.id, res.stats.attempts, "streamed: %s, %d tokens", res.finish_reason,
                     res.stats.generated_tokens)
            yield sse_event("message_stop", {"type": "message_stop"})
        except Exception as exc:  # noqa: BLE001 - the headers went out: the stream ends with an error event
            jlog(logging.WARNING, job.id, attempt, "stream ended early: %s: %s", type(exc).__name__, exc)
            err = stream_error(exc)
            metrics.errors.labels(err.type).inc()
            yield sse_event("error", error_body(err))
        else:
            metrics.requests.labels(PATH, "200").inc()
            metrics.latency.labels(PATH, answer.tier).observe(time.monotonic() - answer.started)
        finally:
            metrics.inflight.dec()
            with contextlib.suppress(Exception):
                await deltas.aclose()  # its channel unsubscribed now, not when the generator is collected
            if not finished:  # the client went away (the request task is being cancelled)
                gw.spawn(self.jobs.cancel(job, "client disconnected from the stream", attempt))


class _Answer:
    """What a message's reply says besides its content: its id and model, how it stopped; its tier
    for the metrics."""

    def __init__(self, sub: Submitted, max_tokens: int, tier: str, started: float):
        self.job, self.model, self.tier, self.started = sub.job, sub.model, tier, started
        self.max_tokens = max_tokens  # what the stop reason is told by

    def head(self) -> dict:
        return {"id": "msg_" + self.job.id, "type": "message", "role": "assistant", "model": self.model}
