"""OpenAI's Files and Batch APIs: the request files, the batches and where they live (no HTTP here;
the gateway's rooms ``gateway/files.py`` and ``gateway/batches.py`` serve them).

**Where things live.**  Every file (an uploaded input, and the output and error files a batch
writes) is one Redis hash, ``<prefix>:file:<id>``: its OpenAI file object and its bytes, or, with
``files_dir`` set, its object in Redis and its bytes in ``<files_dir>/<file id>`` (written to a temporary
name and renamed, so a reader never sees half a file; named by the id mlxq made, never by anything
a caller sent).  Every gateway must then see the same directory: a shared volume.  A file is at most
``max_file_bytes`` (64 MiB by default), checked before it is stored; files stay until deleted
(``DELETE /v1/files/{id}``, which removes both): they take Redis memory, or disk.  A batch is a
hash of its object's fields (``BatchKeys.meta``), with the lines it has answered so far (``results``)
until it ends, when they become its output and error files.

**Validation before anything is queued.**  An upload must be JSONL of OpenAI Batch request lines
(``custom_id``, ``method`` POST, ``url``, ``body``), each ``custom_id`` once: the first line that is
not is named in the 400, as OpenAI's own validation names it.  Creating the batch checks each line's
``url`` against the batch's ``endpoint`` and its body as the endpoint parses it (``bulk._line_params``,
which ``mlxq batch`` uses), and that its model is served, again naming the line.

Each file and batch belongs to the API key that made it (its owner, a hash of the key's hash): another
key gets 404, and ``GET /v1/batches`` lists the caller's own.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import re
import tempfile
import time
import uuid
from typing import Optional

from ..shared.keys import GlobalKeys
from .bulk import OPENAI_BATCH_URLS, _line_params
from .errors import NoModelError
from .registry import known_model

log = logging.getLogger("mlxq.gateway")

# the endpoints a batch may name: its lines run with the same parsing and output as `mlxq batch` (bulk.py)
BATCH_ENDPOINTS = OPENAI_BATCH_URLS
ENDED = ("completed", "failed", "cancelled", "expired")
MAX_METADATA_PAIRS = 16
FILE_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")  # the ids mlxq makes: the only names files_dir holds


def owner_of(key_hash: Optional[str]) -> str:
    """Whose files and batches these are: the caller's API key, as a name that no key can be read from
    (None: anonymous callers, one owner)."""
    return hashlib.sha1(("files:" + (key_hash or "")).encode()).hexdigest()[:20]


def new_id(kind: str) -> str:
    return f"{kind}{uuid.uuid4().hex}"


# -- the request file ------------------------------------------------------------------------------

def request_lines(content: bytes) -> list[tuple[int, dict]]:
    """(line number, request line) of each non-blank line of a batch input file; ValueError naming
    the first line that is not an OpenAI Batch request line, or whose ``custom_id`` came before."""
    lines, seen = [], {}
    for n, raw in enumerate(content.split(b"\n"), start=1):
        if not raw.strip():
            continue
        try:
            item = json.loads(raw)
        except (ValueError, RecursionError):  # (bytes that are not UTF-8 too: a UnicodeDecodeError)
            raise ValueError(f"line {n}: not a JSON object") from None
        if not isinstance(item, dict):
            raise ValueError(f"line {n}: not a JSON object")
        cid = item.get("custom_id")
        if not isinstance(cid, str) or not cid:
            raise ValueError(f"line {n}: custom_id must be a non-empty string")
        if cid in seen:
            raise ValueError(f"line {n}: custom_id {cid!r} is a duplicate of line {seen[cid]}'s")
        seen[cid] = n
        if item.get("method") != "POST":
            raise ValueError(f"line {n}: method must be POST, got {item.get('method')!r}")
        if not isinstance(item.get("url"), str):
            raise ValueError(f"line {n}: url must be a string (the endpoint, e.g. /v1/chat/completions)")
        if not isinstance(item.get("body"), dict):
            raise ValueError(f"line {n}: body must be a JSON object (the request)")
        lines.append((n, item))
    if not lines:
        raise ValueError("the file has no request lines")
    return lines


def check_lines(endpoint: str, lines: list[tuple[int, dict]], registry: Optional[dict]) -> None:
    """Every line runs on ``endpoint`` and parses as its request; its model is one workers serve
    (``registry``; None: unreadable here, the submit checks).  ValueError naming the first that does not."""
    if endpoint not in BATCH_ENDPOINTS:
        raise ValueError(f"endpoint must be one of {', '.join(BATCH_ENDPOINTS)}, got {endpoint!r}")
    for n, item in lines:
        if item["url"] != endpoint:
            raise ValueError(f"line {n}: url {item['url']!r} is not the batch's endpoint {endpoint!r}")
        try:
            params = _line_params(item)[0]
        except ValueError as exc:
            raise ValueError(f"line {n}: {exc}") from None
        if not params.get("model"):
            raise ValueError(f"line {n}: body.model is required")
        if registry is not None:
            try:
                known_model(params["model"], registry)
            except NoModelError as exc:
                raise ValueError(f"line {n}: {exc}") from None


# -- the store -------------------------------------------------------------------------------------

class FileStore:
    """Files and batches in Redis, through ``at(key)`` (the client of the key's slot); the files' bytes
    in ``files_dir`` when it is set."""

    def __init__(self, at, prefix: str, files_dir: Optional[str] = None):
        self.at = at
        self.gkeys = GlobalKeys(prefix)
        self.files_dir = files_dir

    def _path(self, file_id: str) -> str:
        if not FILE_ID.fullmatch(file_id):  # (never: ids are mlxq's own; a path is made of nothing else)
            raise ValueError(f"not a file id: {file_id!r:.140}")
        return os.path.join(self.files_dir, file_id)

    def _write(self, file_id: str, content: bytes) -> None:
        """The bytes under the file's id, all or nothing: a temporary file in the same directory, synced,
        then renamed over the name."""
        fd, tmp = tempfile.mkstemp(dir=self.files_dir, prefix=".upload-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(content)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self._path(file_id))
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def _read(self, file_id: str) -> Optional[bytes]:
        if self.files_dir is None:
            log.error("file %s is in a files_dir, but this gateway has none set: set files_dir (the same "
                      "shared directory on every gateway)", file_id)
            return None
        try:
            with open(self._path(file_id), "rb") as f:
                return f.read()
        except FileNotFoundError:
            log.error("file %s: its bytes are not in files_dir %s (another directory on this gateway?)",
                      file_id, self.files_dir)
            return None

    async def put_file(self, owner: str, filename: str, purpose: str, content: bytes,
                       file_id: Optional[str] = None) -> dict:
        obj = {"id": file_id or new_id("file-"), "object": "file", "bytes": len(content),
               "created_at": int(time.time()), "filename": filename, "purpose": purpose, "status": "processed",
               "expires_at": None, "status_details": None}
        key, listing = self.gkeys.file(obj["id"]), self.gkeys.files(owner)
        fields = {"meta": json.dumps(obj), "owner": owner}
        if self.files_dir is None:
            fields["content"] = content
        else:  # the bytes first: the object never names a file that is not there
            await asyncio.to_thread(self._write, obj["id"], content)
            fields["stored"] = "dir"
        await self.at(key).hset(key, mapping=fields)
        await self.at(listing).zadd(listing, {obj["id"]: time.time()})
        return obj

    async def list_files(self, owner: str, purpose: Optional[str], after: Optional[str],
                         limit: int) -> tuple[list[dict], bool]:
        """The owner's files of ``purpose`` (None: all), newest first, from the one after ``after``;
        (page, more after it)."""
        listing = self.gkeys.files(owner)
        r = self.at(listing)
        start = await self._after(r, listing, after, "file")
        page: list[dict] = []
        while True:
            ids = await r.zrevrange(listing, start, start + limit)
            start += len(ids)
            for i in ids:
                obj = await self.file(owner, i.decode())
                if obj is not None and (purpose is None or obj["purpose"] == purpose):
                    if len(page) == limit:
                        return page, True
                    page.append(obj)
            if len(ids) <= limit:
                return page, False

    @staticmethod
    async def _after(r, listing: str, after: Optional[str], kind: str) -> int:
        """Where a page that starts after ``after`` starts in a newest-first listing."""
        if not after:
            return 0
        rank = await r.zrevrank(listing, after)
        if rank is None:
            raise ValueError(f"after: no {kind} {after!r}")
        return rank + 1

    async def file(self, owner: str, file_id: str) -> Optional[dict]:
        key = self.gkeys.file(file_id)
        meta, who = await self.at(key).hmget(key, ["meta", "owner"])
        return json.loads(meta) if meta is not None and who.decode() == owner else None

    async def content(self, owner: Optional[str], file_id: str) -> Optional[bytes]:
        """The file's bytes (``owner`` None: whoever owns it, for the batch driver)."""
        key = self.gkeys.file(file_id)
        content, who, stored = await self.at(key).hmget(key, ["content", "owner", "stored"])
        if who is None or (owner is not None and who.decode() != owner):
            return None
        if stored is not None:
            return await asyncio.to_thread(self._read, file_id)
        return content

    async def delete_file(self, owner: str, file_id: str) -> bool:
        if await self.file(owner, file_id) is None:
            return False
        key, listing = self.gkeys.file(file_id), self.gkeys.files(owner)
        await self.at(listing).zrem(listing, file_id)
        stored = await self.at(key).hget(key, "stored")
        deleted = bool(await self.at(key).delete(key))
        if stored is not None and self.files_dir is not None:
            with contextlib.suppress(FileNotFoundError):
                await asyncio.to_thread(os.unlink, self._path(file_id))
        return deleted

    # batches
    async def create_batch(self, owner: str, key_hash: Optional[str], endpoint: str, input_file_id: str,
                           window: str, window_s: int, metadata: Optional[dict], total: int,
                           webhook: Optional[str] = None) -> dict:
        """A batch, ``validating`` until a driver takes it up; past ``window_s`` (its ``expires_at``) unended,
        it ends ``expired``."""
        now = int(time.time())
        obj = {"id": new_id("batch_"), "object": "batch", "endpoint": endpoint, "errors": None,
               "input_file_id": input_file_id, "completion_window": window, "status": "validating",
               "output_file_id": None, "error_file_id": None, "created_at": now, "in_progress_at": None,
               "expires_at": now + window_s, "finalizing_at": None, "completed_at": None, "failed_at": None,
               "expired_at": None, "cancelling_at": None, "cancelled_at": None,
               "request_counts": {"total": total, "completed": 0, "failed": 0}, "metadata": metadata}
        keys = self.gkeys.batch(obj["id"])
        fields = {k: json.dumps(v) for k, v in obj.items()}
        await self.at(keys.meta).hset(keys.meta, mapping={**fields, "_owner": json.dumps(owner),
                                                         "_key_hash": json.dumps(key_hash),
                                                         "_webhook": json.dumps(webhook)})
        listing = self.gkeys.batches(owner)
        await self.at(listing).zadd(listing, {obj["id"]: time.time()})
        await self.at(self.gkeys.batches_active).sadd(self.gkeys.batches_active, obj["id"])
        return obj

    async def batch_fields(self, batch_id: str) -> Optional[dict]:
        """The batch's stored fields (``_owner`` and ``_key_hash`` among them), None if there is none."""
        key = self.gkeys.batch(batch_id).meta
        raw = await self.at(key).hgetall(key)
        return {k.decode(): json.loads(v) for k, v in raw.items()} if raw else None

    async def batch(self, owner: str, batch_id: str) -> Optional[dict]:
        """OpenAI's batch object; ``request_counts`` read from the lines answered so far while it runs."""
        fields = await self.batch_fields(batch_id)
        if fields is None or fields.get("_owner") != owner:
            return None
        if fields["status"] not in ENDED:
            keys = self.gkeys.batch(batch_id)
            answered = await self.at(keys.results).hlen(keys.results)
            failed = await self.at(keys.failed).hlen(keys.failed)
            fields["request_counts"] = {**fields["request_counts"], "completed": answered - failed, "failed": failed}
        return {k: v for k, v in fields.items() if not k.startswith("_")}

    async def update_batch(self, batch_id: str, **fields) -> None:
        key = self.gkeys.batch(batch_id).meta
        await self.at(key).hset(key, mapping={k: json.dumps(v) for k, v in fields.items()})

    async def list_batches(self, owner: str, after: Optional[str], limit: int) -> tuple[list[dict], bool]:
        """The owner's batches, newest first, from the one after ``after``; (page, more after it)."""
        listing = self.gkeys.batches(owner)
        r = self.at(listing)
        start = await self._after(r, listing, after, "batch")
        ids = await r.zrevrange(listing, start, start + limit)  # one more than the page: is there more?
        page = [await self.batch(owner, i.decode()) for i in ids[:limit]]
        return [b for b in page if b is not None], len(ids) > limit
