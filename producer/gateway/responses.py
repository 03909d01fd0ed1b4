"""OpenAI's Responses API, as queue jobs: a response IS a job (its id ``resp_`` + the job's id).

    POST   /v1/responses                  (stream or not; background: returns at once, queued)
    GET    /v1/responses/{id}             (poll; ?stream=true&starting_after=N replays the events after N)
    POST   /v1/responses/{id}/cancel
    DELETE /v1/responses/{id}

The job's record keeps what the response object echoes of its request (the ``resp`` field of the
job hash, under the job's TTL), so any gateway answers a poll, a replay or a follow-up
(``previous_response_id``: the earlier job's messages and answer) from Redis alone.  A stream's
events follow from the job's deltas (``ResponseEvents``): a replay numbers them as the live stream
did, and ``starting_after`` skips what the caller has.  ``store: false`` writes no ``resp`` field and
deletes the job's record once its answer is out.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from dataclasses import dataclass
from typing import AsyncIterator, Optional

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ...shared import codec
from ...shared.schemas import Delta, Result
from ..aclient import AsyncClient, AsyncJob
from ..records import TERMINAL, result_from_hash
from ..openai_api import OpenAIError
from ..responses_api import (ResponseEvents, ResponsesRequest, job_id_of, now, output_items, previous_turns,
                             response_id, response_object, status_of)
from .jobs import Refusal, from_first, job_error, jlog, stream_error

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
ENDPOINT = "/v1/responses"  # one metrics label for every route: ids are not labels
# the job's parameters that the Responses API names otherwise
PARAMS = {"response_format": "text.format", "messages": "input"}
RESP_FIELD = "resp"  # the job hash's field that makes a job a stored response (its request's echo)


@dataclass
class _Response:
    """One response: its job, where it lives, and its request's echo (``shell``)."""
    id: str
    job: AsyncJob
    model: str
    shell: dict
    client: AsyncClient
    tier: str
    info: Optional[dict] = None  # the model's registry entry (its tokenizer counts reasoning tokens)

    @property
    def tools(self) -> bool:
        """Whether the job may answer with calls (from the echo: a replay decides as the live stream did)."""
        return bool(self.shell.get("tools")) and self.shell.get("tool_choice") != "none"


class Responses:
    def __init__(self, gw):
        self.gw = gw
        self.jobs = gw.jobs

    def routes(self) -> list[Route]:
        return [Route("/v1/responses", self.create, methods=["POST"]),
                Route("/v1/responses/{id}", self.retrieve, methods=["GET"]),
                Route("/v1/responses/{id}", self.delete, methods=["DELETE"]),
                Route("/v1/responses/{id}/cancel", self.cancel, methods=["POST"])]

    # -- create ------------------------------------------------------------------------------------
    async def create(self, request: Request) -> Response:
        gw = self.gw
        started = time.monotonic()
        got = await self.jobs.admit(request, ResponsesRequest.model_validate, self._plan, prompt_param="input")
        if isinstance(got, Refusal):
            if got.error is not None:
                got.error.param = PARAMS.get(got.error.param, got.error.param)
            return gw.refused(ENDPOINT, got)
        req, sub, tier, client = got
        r = _Response(response_id(sub.job.id), sub.job, sub.model, req.shell(sub.model, now()), client, tier, sub.info)
        if req.kept:  # the echo a poll, a replay and a follow-up read, in the job's record (under its TTL)
            key = client.gkeys.model_keys(sub.model).job(sub.job.id)
            await client.retry(lambda: client.at(key).hset(key, RESP_FIELD, codec.pack(r.shell)))
        if req.background and not req.stream:
            gw.metrics.requests.labels(ENDPOINT, "200").inc()
            return JSONResponse(response_object(r.id, r.shell, "queued"))
        if req.background:  # the job is the caller's to poll or resume: a disconnect leaves it running
            return self._replay(r, after=-1, started=started)
        if req.stream:
            return await self._stream(request, r, started)
        return await self._complete(request, r, started)

    async def _plan(self, req: ResponsesRequest, client: AsyncClient) -> tuple[dict, dict]:
        history = await self._history(client, req.previous_response_id) if req.previous_response_id else None
        # a background response is the caller's to poll: nobody reads its channel from this request,
        # and it is queued even while no worker is live
        return req.submit_kwargs(history), {"stream": req.stream, "subscribe": req.stream or not req.background,
                                            "queue_anyway": bool(req.background)}

    async def _stream(self, request: Request, r: _Response, started: float) -> Response:
        """A stream the request owns: a refusal before the first delta is a plain 4xx, a disconnect cancels."""
        first = await self.jobs.first(request, r.job)
        if first.gone:
            return Response(status_code=499)
        if first.failed is not None:
            await self._forget_unless_kept(r)
            return self.gw.error(ENDPOINT, job_error(first.failed))
        return self._streaming(r, first.deltas, own=True, started=started)

    async def _complete(self, request: Request, r: _Response, started: float) -> Response:
        res = await self.jobs.result_unless_gone(request, r.job)
        if res is None:
            return Response(status_code=499)
        await self._forget_unless_kept(r)
        if res.finish_reason == "error":  # as Chat Completions: a request that failed is an HTTP error
            return self.gw.error(ENDPOINT, job_error(res))
        self.gw.metrics.served(ENDPOINT, r.tier, started, res.stats.generated_tokens)
        return JSONResponse(await self._finished(r, res))

    async def _history(self, client: AsyncClient, prev_id: str) -> list[dict]:
        """The conversation ``previous_response_id`` names: its job's messages and answer."""
        prev = await self._find(client, prev_id, param="previous_response_id")
        res = prev.result
        if res is None:
            raise OpenAIError(400, f"previous response {prev_id!r} is still {prev.status}: wait for it to finish",
                              param="previous_response_id", code="response_in_progress")
        if res.finish_reason in ("error", "cancelled"):
            raise OpenAIError(400, f"previous response {prev_id!r} did not complete ({status_of(None, res)}): "
                                   "there is no answer to go on from", param="previous_response_id",
                              code="invalid_value")
        return previous_turns(prev.req, res, prev.shell.get("instructions") is not None)

    # -- retrieve, cancel, delete -----------------------------------------------------------------
    async def retrieve(self, request: Request) -> Response:
        """The response as it is now; with ``stream=true`` its events (after ``starting_after``),
        replayed and then live until it ends."""
        return await self._by_id(request, self._retrieve)

    async def cancel(self, request: Request) -> Response:
        """Cancel the response's job (a finished one stays as it ended); the response as it ended."""
        return await self._by_id(request, self._cancel)

    async def delete(self, request: Request) -> Response:
        """Delete the response: its job is cancelled if it runs, then its record goes."""
        return await self._by_id(request, self._delete)

    async def _by_id(self, request: Request, answer) -> Response:
        """``answer(request, the response the path names)``; a refusal (401, 404, 400) as an error."""
        client = self.gw.client(request)
        try:
            tier = await client.tier()
            found = await self._find(client, request.path_params["id"])
            return await answer(request, await self._response(client, found, tier), found)
        except Exception as exc:  # noqa: BLE001 - api_error re-raises what is not a refusal
            return self.gw.error(ENDPOINT, *await self.jobs.api_error(exc, client, None, None))

    async def _retrieve(self, request: Request, r: _Response, found: "_Found") -> Response:
        if request.query_params.get("stream", "false").lower() in ("true", "1"):
            return self._replay(r, after=_int_param(request.query_params.get("starting_after"), "starting_after"),
                                started=time.monotonic())
        self.gw.metrics.requests.labels(ENDPOINT, "200").inc()
        if found.result is None:
            return JSONResponse(response_object(r.id, r.shell, status_of(found.status, None)))
        return JSONResponse(await self._finished(r, found.result))

    async def _cancel(self, request: Request, r: _Response, found: "_Found") -> Response:
        res = found.result or await self._cancelled(r.job)
        self.gw.metrics.requests.labels(ENDPOINT, "200").inc()
        return JSONResponse(await self._finished(r, res))

    async def _delete(self, request: Request, r: _Response, found: "_Found") -> Response:
        if found.result is None:
            await self._cancelled(r.job)
        await self._forget(r.client, r.model, r.job.id)
        self.gw.metrics.requests.labels(ENDPOINT, "200").inc()
        return JSONResponse({"id": r.id, "object": "response", "deleted": True})

    async def _cancelled(self, job: AsyncJob) -> Result:
        status = await job.cancel()
        self.gw.metrics.cancels.inc()
        jlog(logging.INFO, job.id, 0, "cancelled by its caller: %s", status)
        return await job.result(timeout=self.gw.result_wait_s)

    # -- where a response lives ---------------------------------------------------------------------
    async def _find(self, client: AsyncClient, resp_id: str, param: Optional[str] = None) -> "_Found":
        """The stored response ``resp_id``: its model's queue is the one whose job record it is."""
        missing = OpenAIError(404, f"no response {resp_id!r}: unknown, deleted, stored with store: false, or "
                                   "expired (a response is kept as long as its job's record, MLXQ_RESULT_TTL_S)",
                              param=param, code="response_not_found")
        job_id = job_id_of(resp_id)
        if job_id is None:
            raise missing
        for model in sorted(await client.models()):
            key = client.gkeys.model_keys(model).job(job_id)
            fields = ("status", RESP_FIELD, "req", "result", "error", "queued_at", "finished_at", "attempts")
            values = await client.retry(lambda: client.at(key).hmget(key, *fields))
            h = {name: v for name, v in zip(fields, values) if v is not None}
            if "status" not in h:
                continue
            if RESP_FIELD not in h:  # a job, but no stored response (another API's, or store: false)
                raise missing
            status = h["status"].decode()
            return _Found(model, job_id, status, codec.unpack(h[RESP_FIELD]), codec.unpack(h.get("req")) or {},
                          result_from_hash(job_id, h) if status in TERMINAL else None)
        raise missing

    async def _response(self, client: AsyncClient, found: "_Found", tier: str) -> _Response:
        return _Response(response_id(found.job_id), await client.job(found.job_id, found.model), found.model,
                         found.shell, client, tier, (await client.models()).get(found.model))

    async def _forget(self, client: AsyncClient, model: str, job_id: str) -> None:
        """Delete a finished job's record, its stream (if it still has one) and its done list."""
        keys = client.gkeys.model_keys(model)
        for key in (keys.job(job_id), keys.events(job_id), keys.done(job_id)):
            await client.retry(lambda k=key: client.at(k).expire(k, 0))  # EXPIRE <= 0 deletes (ACL: expire only)

    async def _forget_unless_kept(self, r: _Response) -> None:
        """``store: false``: the job's record goes once its answer is out."""
        if not r.shell.get("store", True):
            await self._forget(r.client, r.model, r.job.id)

    async def _finished(self, r: _Response, res: Result) -> dict:
        status = status_of(None, res)
        return response_object(r.id, r.shell, status, output_items(r.job.id, res, status), res,
                               await self._reasoning_tokens(r, res))

    async def _reasoning_tokens(self, r: _Response, res: Result) -> int:
        """The reasoning's tokens, counted by the model's tokenizer (0 when the gateway cannot read it)."""
        if not res.reasoning:
            return 0
        names = self.gw.token_names
        if not names.loaded(r.info):
            await asyncio.to_thread(names.tokenizer, r.info)
        count = names.counter(r.info)
        return count(res.reasoning) if count is not None else 0

    # -- streams -------------------------------------------------------------------------------------
    def _replay(self, r: _Response, *, after: int, started: float) -> Response:
        """The job's events numbered past ``after``, from its first delta on (those written already
        read from its durable stream), keep-alives while none comes; a disconnect leaves the job running."""
        deltas = r.job.stream()
        first = asyncio.ensure_future(deltas.__anext__())
        return self._streaming(r, from_first(first, deltas, self.gw.settings.sse_keepalive_s), own=False,
                               after=after, started=started)

    def _streaming(self, r: _Response, deltas, *, own: bool, started: float, after: int = -1) -> Response:
        return StreamingResponse(self._sse(r, deltas, own=own, after=after, started=started),
                                 media_type="text/event-stream", headers=SSE_HEADERS)

    async def _sse(self, r: _Response, deltas: AsyncIterator[Delta | str], *, own: bool, after: int,
                   started: float) -> AsyncIterator[str]:
        """The job's deltas as the Responses API's events, those numbered past ``after``.  ``own``:
        the request owns the job (not a background one): a disconnect cancels it."""
        gw, metrics = self.gw, self.gw.metrics
        events = ResponseEvents(r.id, r.job.id, r.tools)

        def sse(evs: list[dict]) -> str:
            return "".join(f"event: {e['type']}\ndata: {json.dumps(e, separators=(',', ':'))}\n\n"
                           for e in evs if e["sequence_number"] > after)

        metrics.inflight.inc()
        finished, attempt = False, 0
        try:
            chunk = sse(events.start(response_object(r.id, r.shell, "queued" if r.shell.get("background")
                                                     else "in_progress")))
            if chunk:  # (a resumed stream skips what its caller has)
                yield chunk
            async for d in self.jobs.watch(deltas, ENDPOINT, r.tier, started if own else None):
                if isinstance(d, str):
                    yield d
                    continue
                attempt = max(attempt, d.attempt)
                chunk = sse(events.feed(d))
                if chunk:
                    yield chunk
            res = await r.job.result(timeout=gw.result_wait_s)
            finished = True
            yield sse(events.finish(await self._finished(r, res)))
        except Exception as exc:  # noqa: BLE001 - the headers went out: a 500 now is an ASGI error
            jlog(logging.WARNING, r.job.id, attempt, "stream ended early: %s: %s", type(exc).__name__, exc)
            err = stream_error(exc)
            metrics.errors.labels(err.type).inc()
            yield sse([{"type": "error", "sequence_number": max(events.seq, after + 1), "code": err.code,
                        "message": err.message, "param": err.param}])
        else:
            metrics.requests.labels(ENDPOINT, "200").inc()
            metrics.latency.labels(ENDPOINT, r.tier).observe(time.monotonic() - started)
            if own:
                gw.spawn(self.jobs.streamed(r.job))
        finally:
            metrics.inflight.dec()
            with contextlib.suppress(Exception):
                await deltas.aclose()
            if not finished and own:  # the client went away (the request task is being cancelled)
                gw.spawn(self.jobs.cancel(r.job, "client disconnected from the stream", attempt))
            if finished and own:
                gw.spawn(self._forget_unless_kept(r))


@dataclass
class _Found:
    model: str
    job_id: str
    status: str
    shell: dict
    req: dict
    result: Optional[Result]


def _int_param(value: Optional[str], name: str) -> int:
    if value is None:
        return -1
    try:
        return int(value)
    except ValueError:
        raise OpenAIError(400, f"{name} must be an integer (a sequence_number)", param=name,
                          code="invalid_value") from None
