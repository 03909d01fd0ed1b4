"""OpenAI's Files API, for the Batch API's request files (``producer/openai_batch.py`` says where they live).

    POST   /v1/files                 (multipart: ``file``, ``purpose=batch``; a JSONL of request lines)
    GET    /v1/files                 (the caller's, newest first; ``purpose``, ``after``, ``limit``)
    GET    /v1/files/{id}            (the file object)
    GET    /v1/files/{id}/content    (the bytes: an input, or a batch's output or error file)
    DELETE /v1/files/{id}

An upload is capped at ``max_file_bytes`` (413 past it, read no further) and checked line by line
before it is stored: the 400 names the first line that is not a request line, or repeats a
``custom_id``.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Optional

from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ...shared import apikeys
from ..openai_api import OpenAIError
from ..openai_batch import FileStore, owner_of, request_lines
from .jobs import bearer, read_body

log = logging.getLogger("mlxq.gateway")

MULTIPART_SLACK = 64 * 1024  # the form's own bytes around the file (boundaries, headers, purpose)
PURPOSES = ("batch",)  # the files this gateway takes: request files for the Batch API


def owner(request: Request) -> str:
    token = bearer(request)
    return owner_of(apikeys.key_hash(token) if token else None)


def store(gw, client) -> FileStore:
    return FileStore(client.at, gw.settings.prefix, gw.settings.files_dir)


async def serve(gw, request: Request, endpoint: str, answer) -> Response:
    """``await answer(client)`` (a dict, sent as JSON, or a ``Response``) for a caller whose key the
    registry knows; what it raises as OpenAI's error (``endpoint``: the metrics label)."""
    client = gw.client(request)
    try:
        await client.tier()  # 401 before anything else (the body is not read)
        out = await answer(client)
    except ClientDisconnect:  # gone while its upload was still coming: nothing was stored
        return gw.gone(endpoint)
    except Exception as exc:  # noqa: BLE001 - api_error re-raises what is not a refusal
        return gw.error(endpoint, *await gw.jobs.api_error(exc, client, None, None))
    gw.metrics.requests.labels(endpoint, "200").inc()
    return out if isinstance(out, Response) else JSONResponse(out)


class Files:
    def __init__(self, gw):
        self.gw = gw

    def routes(self) -> list[Route]:
        return [Route("/v1/files", self.create, methods=["POST"]),
                Route("/v1/files", self.list, methods=["GET"]),
                Route("/v1/files/{file_id}", self.retrieve, methods=["GET"]),
                Route("/v1/files/{file_id}", self.delete, methods=["DELETE"]),
                Route("/v1/files/{file_id}/content", self.content, methods=["GET"])]

    async def create(self, request: Request) -> Response:
        async def answer(client) -> dict:
            filename, purpose, content = await self._form(request)
            if purpose not in PURPOSES:
                raise OpenAIError(400, f"purpose must be one of {', '.join(PURPOSES)}, got {purpose!r}",
                                  param="purpose", code="invalid_purpose")
            try:  # off the event loop: a file of 100,000 lines takes a while to parse
                await asyncio.to_thread(request_lines, content)
            except ValueError as exc:
                raise OpenAIError(400, f"invalid batch file {filename!r}: {exc}", param="file",
                                  code="invalid_file") from None
            obj = await store(self.gw, client).put_file(owner(request), filename, purpose, content)
            log.info("file %s stored: %s, %d bytes", obj["id"], obj["filename"], obj["bytes"])
            return obj

        return await serve(self.gw, request, "/v1/files", answer)

    async def _form(self, request: Request) -> tuple[str, Optional[str], bytes]:
        """(file name, purpose, the file's bytes) of the upload, read no further than its cap."""
        cap = self.gw.settings.max_file_bytes
        raw = await read_body(request, cap + MULTIPART_SLACK)

        async def chunks():
            yield raw

        if not request.headers.get("content-type", "").startswith("multipart/form-data"):
            raise OpenAIError(400, "the upload must be multipart/form-data with a file and a purpose",
                              code="invalid_request")
        try:
            form = await MultiPartParser(request.headers, chunks(), max_files=1, max_fields=8,
                                         max_part_size=cap + 1).parse()
        except MultiPartException as exc:
            raise OpenAIError(400, f"the upload is not a valid form: {exc.message}", code="invalid_request") from None
        upload, purpose = form.get("file"), form.get("purpose")
        if not isinstance(upload, UploadFile):
            raise OpenAIError(400, "the form has no file part", param="file", code="invalid_request")
        content = await upload.read()
        if len(content) > cap:
            raise OpenAIError(413, f"the file is over the gateway's limit of {cap} bytes (max_file_bytes)",
                              param="file", code="file_too_large")
        return upload.filename or "upload.jsonl", purpose if isinstance(purpose, str) else None, content

    async def list(self, request: Request) -> Response:
        async def answer(client) -> dict:
            q = request.query_params
            limit = page_limit(q.get("limit", "10000"), 10_000)
            page, more = await store(self.gw, client).list_files(owner(request), q.get("purpose"), q.get("after"),
                                                                 limit)
            return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                    "last_id": page[-1]["id"] if page else None, "has_more": more}

        return await serve(self.gw, request, "/v1/files", answer)

    async def retrieve(self, request: Request) -> Response:
        async def answer(client) -> dict:
            return found(await store(self.gw, client).file(owner(request), request.path_params["file_id"]),
                         request)

        return await serve(self.gw, request, "/v1/files/{file_id}", answer)

    async def content(self, request: Request) -> Response:
        async def answer(client) -> Response:
            content = await store(self.gw, client).content(owner(request), request.path_params["file_id"])
            return Response(found(content, request), media_type="application/jsonl")

        return await serve(self.gw, request, "/v1/files/{file_id}/content", answer)

    async def delete(self, request: Request) -> Response:
        async def answer(client) -> dict:
            file_id = request.path_params["file_id"]
            found(await store(self.gw, client).delete_file(owner(request), file_id) or None, request)
            return {"id": file_id, "object": "file", "deleted": True}

        return await serve(self.gw, request, "/v1/files/{file_id}", answer)


def page_limit(text: str, most: int) -> int:
    if not text.isdigit() or not 1 <= int(text) <= most:
        raise OpenAIError(400, f"limit must be an integer from 1 to {most}, got {text!r}", param="limit")
    return int(text)


def found(what, request: Request):
    """``what``, unless it is None: then a 404 naming the file asked for."""
    if what is None:
        file_id = request.path_params["file_id"]
        raise OpenAIError(404, f"no file {file_id!r}", param="file_id", code="file_not_found")
    return what
