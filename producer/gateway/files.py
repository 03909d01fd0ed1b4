"""OpenAI's Files API, for the Batch API's request files (``producer/openai_batch.py`` says where they live).

    POST   /v1/files                 (multipart: ``file``, ``purpose=batch``; a JSONL of request lines)
    GET    /v1/files/{id}            (the file object)
    GET    /v1/files/{id}/content    (the bytes: an input, or a batch's output or error file)
    DELETE /v1/files/{id}

An upload is capped at ``max_file_bytes`` (413 past it, read no further) and checked line by line
before it is stored: the 400 names the first line that is not a request line, or repeats a
``custom_id``.
"""

from __future__ import annotations

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


def store(gw, request: Request) -> FileStore:
    return FileStore(gw.client(request).at, gw.settings.prefix)


class Files:
    def __init__(self, gw):
        self.gw = gw

    def routes(self) -> list[Route]:
        return [Route("/v1/files", self.create, methods=["POST"]),
                Route("/v1/files/{file_id}", self.retrieve, methods=["GET"]),
                Route("/v1/files/{file_id}", self.delete, methods=["DELETE"]),
                Route("/v1/files/{file_id}/content", self.content, methods=["GET"])]

    async def create(self, request: Request) -> Response:
        gw, endpoint = self.gw, "/v1/files"
        try:
            await gw.client(request).tier()  # 401 before the body is read
            filename, purpose, content = await self._form(request)
            if purpose not in PURPOSES:
                raise OpenAIError(400, f"purpose must be one of {', '.join(PURPOSES)}, got {purpose!r}",
                                  param="purpose", code="invalid_purpose")
            try:
                request_lines(content)
            except ValueError as exc:
                raise OpenAIError(400, f"invalid batch file {filename!r}: {exc}", param="file",
                                  code="invalid_file") from None
            obj = await store(gw, request).put_file(owner(request), filename, purpose, content)
        except ClientDisconnect:
            return gw.gone(endpoint)
        except Exception as exc:  # noqa: BLE001 - api_error re-raises what is not a refusal
            return gw.error(endpoint, *await gw.jobs.api_error(exc, gw.client(request), None, None))
        log.info("file %s stored: %s, %d bytes", obj["id"], obj["filename"], obj["bytes"])
        gw.metrics.requests.labels(endpoint, "200").inc()
        return JSONResponse(obj)

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

    async def retrieve(self, request: Request) -> Response:
        return await self._read(request, "/v1/files/{file_id}", content=False)

    async def content(self, request: Request) -> Response:
        return await self._read(request, "/v1/files/{file_id}/content", content=True)

    async def _read(self, request: Request, endpoint: str, content: bool) -> Response:
        gw, file_id = self.gw, request.path_params["file_id"]
        try:
            await gw.client(request).tier()
            files = store(gw, request)
            found = await (files.content if content else files.file)(owner(request), file_id)
            if found is None:
                raise no_file(file_id)
        except Exception as exc:  # noqa: BLE001
            return gw.error(endpoint, *await gw.jobs.api_error(exc, gw.client(request), None, None))
        gw.metrics.requests.labels(endpoint, "200").inc()
        if content:
            return Response(found, media_type="application/jsonl")
        return JSONResponse(found)

    async def delete(self, request: Request) -> Response:
        gw, file_id, endpoint = self.gw, request.path_params["file_id"], "/v1/files/{file_id}"
        try:
            await gw.client(request).tier()
            if not await store(gw, request).delete_file(owner(request), file_id):
                raise no_file(file_id)
        except Exception as exc:  # noqa: BLE001
            return gw.error(endpoint, *await gw.jobs.api_error(exc, gw.client(request), None, None))
        gw.metrics.requests.labels(endpoint, "200").inc()
        return JSONResponse({"id": file_id, "object": "file", "deleted": True})


def no_file(file_id: str) -> OpenAIError:
    return OpenAIError(404, f"no file {file_id!r}", param="file_id", code="file_not_found")
