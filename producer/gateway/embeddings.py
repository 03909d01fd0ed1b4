"""OpenAI's Embeddings, as queue jobs.

    POST /v1/embeddings          (one embedding job per input; the worker batches them)
    POST /v1/batch/embeddings    (the same at the low tier)

``input`` is a string, a list of strings, a list of token ids or a list of those; ``encoding_format``
float (a list of numbers) or base64 (the little-endian float32 values, as OpenAI sends them and as
the job's result holds them); ``dimensions`` keeps the first this many values, renormalised, and one
above the model's embedding size is refused.  Every input is checked before any job is queued: a
bad one is a 400 with nothing queued.  The request and response shapes are ``openai_embeddings``'s,
which the Batch API's ``/v1/embeddings`` lines share (``bulk.py``).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Optional

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ...shared.schemas import Result
from ..aclient import AsyncClient, AsyncJob
from ..core import embed_jobs, embed_kwargs
from ..errors import ContextLengthError
from ..openai_api import OpenAIError
from ..openai_embeddings import MAX_INPUTS, EmbeddingRequest, embeddings_body
from .jobs import Refusal, job_error

PATH = "/v1/embeddings"


class Planned:
    """A request's model and its jobs' ``submit`` arguments, every one checked."""

    def __init__(self, model: str, jobs: list[dict[str, Any]]):
        self.model, self.jobs = model, jobs


async def plan(gw, client: AsyncClient, req: EmbeddingRequest) -> Planned:
    """Check every input against the model (its context, its embedding size) before any is queued:
    ValueError (a 400) for the first that cannot run."""
    if req.count() > MAX_INPUTS:
        raise OpenAIError(400, f"input holds {req.count()} items, over the {MAX_INPUTS} one request may",
                          param="input", code="invalid_value")
    model = req.model or await client.model
    info = (await client.models()).get(model)
    if not gw.token_names.loaded(info):  # read tokenizer.json off the event loop
        await asyncio.to_thread(gw.token_names.tokenizer, info)
    try:
        jobs, _ = embed_jobs(model, req.input, embed_kwargs(req.dimensions, req.pooling, True), info,
                             gw.settings.max_prompt_bytes, gw.token_names.counter(info))
    except ContextLengthError as exc:
        raise OpenAIError(400, str(exc), param="input", code="context_length_exceeded") from None
    return Planned(model, jobs)


def first_failed(results: list[Result]) -> Optional[Result]:
    return next((r for r in results if r.embedding is None), None)


class Embeddings:
    def __init__(self, gw):
        self.gw = gw
        self.jobs = gw.jobs

    def routes(self) -> list[Route]:
        return [Route(PATH, self.create, methods=["POST"]),
                Route("/v1/batch/embeddings", self.create, methods=["POST"])]

    async def create(self, request: Request) -> Response:
        gw, endpoint = self.gw, request.url.path
        floor = "low" if endpoint.startswith("/v1/batch/") else None
        started = time.monotonic()
        got = await self.jobs.admit(request, EmbeddingRequest.model_validate,
                                    lambda req, client: plan(gw, client, req), floor=floor, prompt_param="input",
                                    queue=self._queue)
        if isinstance(got, Refusal):
            return gw.refused(endpoint, got)
        req, (planned, jobs), tier, _ = got
        results = []
        for i, job in enumerate(jobs):
            res = await self.jobs.result_unless_gone(request, job)
            if res is None:  # the client left: that job is cancelled, and so are the rest
                for rest in jobs[i + 1:]:
                    gw.spawn(self.jobs.cancel(rest, "client disconnected"))
                return Response(status_code=499)
            results.append(res)
        failed = first_failed(results)
        if failed is not None:
            return gw.error(endpoint, job_error(failed))
        gw.metrics.served(endpoint, tier, started, 0)
        return JSONResponse(embeddings_body(req.encoding_format, planned.model, results))

    async def _queue(self, request: Request, client: AsyncClient, tier: str, floor: Optional[str],
                     planned: Planned) -> tuple[Planned, list[AsyncJob]]:
        """Queue every input's job; if one is refused (a full queue), the ones queued before it are
        cancelled and the refusal raised."""
        jobs: list[AsyncJob] = []
        try:
            for kw in planned.jobs:
                sub = await self.jobs.submit(request, client, tier=tier, floor=floor, model=planned.model, kwargs=kw,
                                             prompt_param="input", stream=False)
                jobs.append(sub.job)
        except Exception:
            for job in jobs:
                self.gw.spawn(self.jobs.cancel(job, "another input of its request was refused"))
            raise
        return planned, jobs
