"""OpenAI's Chat Completions and Completions, as queue jobs.

    POST /v1/chat/completions, /v1/completions                (stream or not; usage from the job's stats)
    POST /v1/batch/chat/completions, /v1/batch/completions    (the same at the low tier)

A request that cannot run gets a 400 before anything is streamed (``Jobs.first``); a refusal after
keep-alives sent the headers is OpenAI's error chunk with no ``[DONE]``.  A client that disconnects
cancels its job.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import AsyncIterator, Optional

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ...shared.schemas import Delta
from ..aclient import AsyncJob
from ..openai_api import (ChatCompletionRequest, ChatDeltas, CompletionRequest, LogprobFormatter, OpenAIError,
                          choice, failed_output, finish_fields, now_s, usage)
from .jobs import Refusal, job_error, jlog, refused, sse_data, stream_error

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class ChatCompletions:
    def __init__(self, gw):
        self.gw = gw
        self.jobs = gw.jobs

    def routes(self) -> list[Route]:
        return [Route("/v1/chat/completions", self.chat, methods=["POST"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/batch/chat/completions", self.chat, methods=["POST"]),
                Route("/v1/batch/completions", self.completions, methods=["POST"])]

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, ChatCompletionRequest, chat=True)

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, CompletionRequest, chat=False)

    async def _generate(self, request: Request, schema, chat: bool) -> Response:
        gw, endpoint = self.gw, request.url.path
        floor = "low" if endpoint.startswith("/v1/batch/") else None
        started = time.monotonic()
        got = await self.jobs.admit(request, schema.model_validate, _plan, floor=floor,
                                    prompt_param="messages" if chat else "prompt")
        if isinstance(got, Refusal):
            return gw.refused(endpoint, got)
        req, sub, tier, _ = got
        fmt = LogprobFormatter(gw.token_names.for_model(sub.info), req.top_n)
        meta = _Meta(id=("chatcmpl-" if chat else "cmpl-") + sub.job.id, model=sub.model, created=now_s(), chat=chat,
                     endpoint=endpoint, started=started, include_usage=req.include_usage, tools=sub.tools,
                     n=req.n or 1, tier=tier)
        if req.stream:
            return await self._stream(request, sub.job, meta, fmt)
        return await self._complete(request, sub.job, meta, fmt)

    async def _stream(self, request: Request, job: AsyncJob, meta: "_Meta", fmt: LogprobFormatter) -> Response:
        first = await self.jobs.first(request, job)
        if first.gone:
            return Response(status_code=499)
        if first.failed is not None:
            return self.gw.error(meta.endpoint, job_error(first.failed))
        return StreamingResponse(self._sse(job, meta, fmt, first.deltas), media_type="text/event-stream",
                                 headers=SSE_HEADERS)

    async def _complete(self, request: Request, job: AsyncJob, meta: "_Meta", fmt: LogprobFormatter) -> Response:
        res = await self.jobs.result_unless_gone(request, job)
        if res is None:
            return Response(status_code=499)
        failed = failed_output(res)
        if failed is not None:
            return self.gw.error(meta.endpoint, job_error(failed))
        self.gw.metrics.served(meta.endpoint, meta.tier, meta.started, res.stats.generated_tokens)
        obj = "chat.completion" if meta.chat else "text_completion"
        return JSONResponse({"id": meta.id, "object": obj, "created": meta.created, "model": meta.model,
                             "choices": [choice(meta.chat, out, fmt) for out in res.outputs], "usage": usage(res),
                             "system_fingerprint": None, "stats": res.stats.model_dump()})

    async def _sse(self, job: AsyncJob, meta: "_Meta", fmt: LogprobFormatter,
                   deltas: AsyncIterator[Delta | str]) -> AsyncIterator[str]:
        """The job's deltas as OpenAI's SSE events; a ``str`` among them (a keep-alive comment) goes out as is."""
        gw, metrics = self.gw, self.gw.metrics
        metrics.inflight.inc()
        finished, attempt = False, 0
        # per choice (a job's sample): its chat deltas and its text offset
        chats = [ChatDeltas() for _ in range(meta.n)]
        offsets = [0] * meta.n
        ended: set[int] = set()
        try:
            if meta.chat:  # content null first when the answer may be calls only, as OpenAI streams them
                for i in range(meta.n):
                    yield sse_data(meta.chunk({"role": "assistant", "content": None if meta.tools else ""}, None,
                                              index=i))
            async for d in self.jobs.watch(deltas, meta.endpoint, meta.tier, meta.started):
                if isinstance(d, str):
                    yield d
                    continue
                attempt = max(attempt, d.attempt)
                i = d.sample or 0
                if d.finish_reason == "error":
                    finished = True
                    if refused(d):  # refused after the keep-alives sent the headers: its 400 as an event,
                        # the stream's end (no [DONE]), as OpenAI ends a stream that failed
                        res = await job.result(timeout=gw.result_wait_s)
                        jlog(logging.INFO, job.id, res.stats.attempts, "refused while streaming: %s", res.error)
                        err = job_error(res)
                        metrics.errors.labels(err.type).inc()
                        yield sse_data(err.body())
                        return
                    yield sse_data(OpenAIError(500, d.error or "generation failed", "server_error",
                                               code="job_failed").body())
                    if d.sample is not None and len(ended) + 1 < meta.n:
                        # one sample of several failed: the stream ends with its error, so the samples
                        # still running would run for nobody
                        gw.spawn(self.jobs.cancel(job, f"sample {i} failed, which ended the stream", attempt))
                    break
                delta = chats[i].delta(d) if meta.chat else d.text
                if meta.chat and delta and d.finish_reason:  # as OpenAI: the finish in a chunk of its own
                    yield sse_data(_delta_chunk(meta, d.model_copy(update={"finish_reason": None}), delta,
                                                fmt, offsets[i]))
                    d, delta = d.model_copy(update={"logprobs": None}), {}
                if delta or d.logprobs or d.finish_reason:
                    yield sse_data(_delta_chunk(meta, d, delta, fmt, offsets[i]))
                offsets[i] += len(d.text)
                if d.finish_reason:
                    ended.add(i)
                    finished = d.sample is None or len(ended) == meta.n
            if meta.include_usage and finished:
                res = await job.result(timeout=gw.result_wait_s)
                yield sse_data(meta.usage_chunk(usage(res), res.stats.model_dump()))
        except Exception as exc:  # noqa: BLE001 - the headers went out: a 500 now is an ASGI error
            # the stream cannot go on: it ends as OpenAI ends one, with an error event and no [DONE]
            jlog(logging.WARNING, job.id, attempt, "stream ended early: %s: %s", type(exc).__name__, exc)
            err = stream_error(exc)
            metrics.errors.labels(err.type).inc()
            yield sse_data(err.body())
        else:
            yield "data: [DONE]\n\n"
            if finished:  # its tokens and log line, off the response: it ends at [DONE], not a read later
                gw.spawn(self.jobs.streamed(job))
            metrics.requests.labels(meta.endpoint, "200").inc()
            metrics.latency.labels(meta.endpoint, meta.tier).observe(time.monotonic() - meta.started)
        finally:
            metrics.inflight.dec()
            # the job's stream ends here however this one does (a sample's error breaks out of it):
            # its channel is unsubscribed now, not whenever the generator is collected
            with contextlib.suppress(Exception):
                await deltas.aclose()
            if not finished:  # the client went away (the request task is being cancelled)
                gw.spawn(self.jobs.cancel(job, "client disconnected from the stream", attempt))


def _plan(req, client) -> tuple[dict, dict]:
    return req.submit_kwargs(), {"stream": req.stream}


def _delta_chunk(meta: "_Meta", d: Delta, delta, fmt: LogprobFormatter, offset: int) -> dict:
    """``delta``: the chunk's chat delta (``ChatDeltas``), or a completion's text."""
    reason, i = d.finish_reason, d.sample or 0
    if meta.chat:
        lp = fmt.chat(d.logprobs) if d.logprobs else None
        return meta.chunk(delta, reason, lp, index=i)
    return meta.chunk(delta, reason, fmt.completion(d.logprobs, offset) if d.logprobs else None, index=i)


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
