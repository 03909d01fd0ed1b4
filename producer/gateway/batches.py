"""OpenAI's Batch API: a request file's lines run as low-tier queue jobs.

    POST /v1/batches                 (input_file_id, endpoint, completion_window "24h", metadata; mlxq's
                                      ``webhook``: a URL POSTed the batch's summary when it ends)
    GET  /v1/batches/{id}            (status, request_counts, output_file_id, error_file_id)
    GET  /v1/batches                 (the caller's, newest first; ``after``, ``limit``)
    POST /v1/batches/{id}/cancel

**Who drives a batch.**  No HTTP request stays open while a batch runs: every gateway runs a
``BatchDriver`` task.  It takes each unfinished batch (the ``batches_active`` set) under a lease in
Redis (``BatchKeys.lease``, renewed while it runs it), submits its lines ``batch_window`` at a time and
polls their job records, as ``mlxq batch`` does, with the same machinery (``bulkmap.bulk_submit``
and ``reap_lines``, which submits a lost record again; ``bulk.batch_line``).  A gateway that stops or dies leaves the lease to expire;
then any gateway (this one restarted, too) takes the batch up again.

**Each line once.**  A line's idempotency key is ``openai-batch:<batch id>:<custom_id>``, under the
batch creator's API key: a driver that takes up a batch submits again every line not yet answered,
and a line whose job was queued before finds that job and waits for it rather than running it again.
An answered line is written once (``HSETNX``): a worker killed mid-line has its job retried by the
queue (the job's lease), and the line is answered when the job ends.  A job record lost with a
failed Redis master is submitted again under the same key (``Submitted.again``).

Lines run at the low tier, or the creator's key's tier where that is lower.  A line refused because
the queue is full is queued at a later poll; one refused because the creator's key is over its daily
token quota waits for the quota's reset (``QuotaExceeded.retry_after_s``), the batch still running,
and asks again at least every ``QUOTA_RECHECK_S`` (a quota an operator raised or lifted meanwhile).  The batch ends
``completed`` (or ``cancelled``) with an output file of the lines answered 200 and an error file of
the rest, each in OpenAI's line format and in the input's order.

**Its window.**  ``completion_window`` is one of ``completion_windows`` (OpenAI's ``24h`` by default).  A
batch not ended by its ``expires_at`` ends ``expired``, as OpenAI's do: its jobs still queued are
cancelled (never run), the lines answered stay in the output file and every other line goes to the
error file with OpenAI's ``batch_expired`` code.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections import deque
from typing import Optional

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ...shared import apikeys
from ...shared.protocol import OverloadError, QuotaExceeded
from ...shared.settings import completion_windows
from ...shared.steps import arun_steps
from ..aclient import AsyncClient
from ..bulk import KINDS, _line_params, batch_line, refused_line
from ..bulkmap import BULK_TIER_FLOOR, Line, RunWebhook, Submitted, _async_io, bulk_submit, reap_lines
from ..openai_api import LogprobFormatter, OpenAIError
from ..openai_batch import BATCH_ENDPOINTS, ENDED, MAX_METADATA_PAIRS, check_lines, request_lines
from ..webhooks import WebhookRefused, check_url
from .files import owner, page_limit, serve, store
from .jobs import bearer, json_body

log = logging.getLogger("mlxq.gateway")


class Batches:
    def __init__(self, gw):
        self.gw = gw
        self.driver = BatchDriver(gw)

    def routes(self) -> list[Route]:
        return [Route("/v1/batches", self.create, methods=["POST"]),
                Route("/v1/batches", self.list, methods=["GET"]),
                Route("/v1/batches/{batch_id}", self.retrieve, methods=["GET"]),
                Route("/v1/batches/{batch_id}/cancel", self.cancel, methods=["POST"])]

    async def create(self, request: Request) -> Response:
        async def answer(client) -> dict:
            body = await json_body(request, self.gw.max_body_bytes)
            target, window, metadata = body.get("endpoint"), body.get("completion_window"), body.get("metadata")
            windows = completion_windows(self.gw.settings.completion_windows)
            if window not in windows:
                raise OpenAIError(400, f"completion_window must be one of {', '.join(windows)}, got {window!r}",
                                  param="completion_window")
            if target not in BATCH_ENDPOINTS:
                raise OpenAIError(400, f"endpoint must be one of {', '.join(BATCH_ENDPOINTS)}, got {target!r}",
                                  param="endpoint")
            check_metadata(metadata)
            webhook = body.get("webhook")  # (the OpenAI SDK sends it with extra_body=)
            if webhook is not None:
                try:  # (off the event loop: the host is resolved)
                    await asyncio.to_thread(check_url, webhook if isinstance(webhook, str) else "", self.gw.settings)
                except WebhookRefused as exc:
                    raise OpenAIError(400, str(exc), param="webhook", code="invalid_webhook") from None
            file_id = body.get("input_file_id")
            files, who = store(self.gw, client), owner(request)
            meta = await files.file(who, file_id) if isinstance(file_id, str) else None
            if meta is None or meta["purpose"] != "batch":
                raise OpenAIError(404 if meta is None else 400, f"no batch input file {file_id!r}",
                                  param="input_file_id", code="file_not_found" if meta is None else "invalid_file")
            content, registry = await files.content(who, file_id), await client._registry()
            try:  # off the event loop: each line's body is parsed as its endpoint parses it
                lines = await asyncio.to_thread(request_lines, content)
                await asyncio.to_thread(check_lines, target, lines, registry)
            except ValueError as exc:  # nothing queued: the file's line (or the endpoint) is named
                raise OpenAIError(400, f"input file {file_id!r}: {exc}", param="input_file_id",
                                  code="invalid_file") from None
            token = bearer(request)
            obj = await files.create_batch(who, apikeys.key_hash(token) if token else None, target, file_id, window,
                                           windows[window], metadata, len(lines), webhook)
            log.info("batch %s created: %d lines of %s on %s", obj["id"], len(lines), file_id, target)
            self.driver.wake.set()
            return obj

        return await serve(self.gw, request, "/v1/batches", answer)

    async def retrieve(self, request: Request) -> Response:
        return await serve(self.gw, request, "/v1/batches/{batch_id}", lambda client: self._batch(request, client))

    async def _batch(self, request: Request, client) -> dict:
        batch_id = request.path_params["batch_id"]
        obj = await store(self.gw, client).batch(owner(request), batch_id)
        if obj is None:
            raise OpenAIError(404, f"no batch {batch_id!r}", param="batch_id", code="batch_not_found")
        return obj

    async def list(self, request: Request) -> Response:
        async def answer(client) -> dict:
            limit = page_limit(request.query_params.get("limit", "20"), 100)
            page, more = await store(self.gw, client).list_batches(owner(request), request.query_params.get("after"),
                                                                   limit)
            return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                    "last_id": page[-1]["id"] if page else None, "has_more": more}

        return await serve(self.gw, request, "/v1/batches", answer)

    async def cancel(self, request: Request) -> Response:
        """A running batch becomes ``cancelling``: its driver queues no more lines, cancels the jobs
        queued or running, and ends it ``cancelled`` with the lines answered so far."""
        async def answer(client) -> dict:
            obj = await self._batch(request, client)
            if obj["status"] in ("validating", "in_progress"):
                await store(self.gw, client).update_batch(obj["id"], status="cancelling",
                                                          cancelling_at=int(time.time()))
                self.driver.wake.set()
                return await self._batch(request, client)
            if obj["status"] not in ("cancelling", "cancelled"):
                raise OpenAIError(409, f"batch {obj['id']!r} is {obj['status']}: it can no longer be cancelled",
                                  code="batch_not_cancellable")
            return obj

        return await serve(self.gw, request, "/v1/batches/{batch_id}/cancel", answer)


def check_metadata(metadata) -> None:
    if metadata is None:
        return
    if (not isinstance(metadata, dict) or len(metadata) > MAX_METADATA_PAIRS
            or not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())):
        raise OpenAIError(400, f"metadata must be an object of at most {MAX_METADATA_PAIRS} string pairs",
                          param="metadata")


# -- the driver ------------------------------------------------------------------------------------

class _CreatorClient(AsyncClient):
    """The gateway's client submitting as the batch's creator: the tier and the idempotency scope of
    the creator's key, by its hash (the key itself is not kept)."""

    def __init__(self, key_hash: Optional[str], **kw):
        super().__init__(**kw)
        self._creator = key_hash

    @property
    def key_hash(self) -> Optional[str]:
        return self._creator


class BatchDriver:
    """Every unfinished batch is run by one gateway's driver at a time, under a lease in Redis."""

    LEASE_S = 15.0  # a gateway gone this long: another takes its batches up
    SCAN_S = 1.0  # unfinished batches looked for this often (and at once when this gateway makes one)
    POLL_S = 0.05  # a running batch's job records read this often

    def __init__(self, gw):
        self.gw = gw
        self.token = uuid.uuid4().hex
        self.wake = asyncio.Event()
        self.running: dict[str, asyncio.Task] = {}
        self._task: Optional[asyncio.Task] = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._scan())

    async def stop(self) -> None:
        """Stop driving; each batch's lease is released, so a gateway may take it up at once."""
        tasks = [t for t in (self._task, *self.running.values()) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _client(self, key_hash: Optional[str] = None) -> AsyncClient:
        gw = self.gw
        return _CreatorClient(key_hash, settings=gw.settings, redis_client=gw.redis, subscriber=gw.subscriber,
                              watch=gw.watch)

    async def _scan(self) -> None:
        client = self._client()
        active = client.gkeys.batches_active
        while True:
            try:
                for raw in await client.at(active).smembers(active):
                    batch_id = raw.decode()
                    if batch_id not in self.running and await self._take(client, batch_id):
                        task = asyncio.get_running_loop().create_task(self._drive(batch_id))
                        self.running[batch_id] = task
                        task.add_done_callback(lambda _, b=batch_id: self.running.pop(b, None))
            except Exception as exc:  # noqa: BLE001 - Redis away a while: the next scan tries again
                log.warning("batch driver: scan failed: %s: %s", type(exc).__name__, exc)
            self.wake.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.wake.wait(), self.SCAN_S)

    async def _take(self, client: AsyncClient, batch_id: str) -> bool:
        key = client.gkeys.batch(batch_id).lease
        return bool(await client.at(key).set(key, self.token, nx=True, px=int(self.LEASE_S * 1000)))

    async def _renew(self, client: AsyncClient, batch_id: str) -> bool:
        """Still this gateway's batch: its lease renewed (WATCH: never one another gateway took)."""
        key = client.gkeys.batch(batch_id).lease
        async with client.at(key).pipeline(transaction=True) as pipe:
            try:
                await pipe.watch(key)
                if await pipe.get(key) != self.token.encode():
                    return False
                pipe.multi()
                pipe.pexpire(key, int(self.LEASE_S * 1000))
                await pipe.execute()
            except Exception as exc:  # noqa: BLE001 - a WatchError too: taken meanwhile
                log.warning("batch %s: lease not renewed: %s", batch_id, exc)
                return False
        return True

    async def _drive(self, batch_id: str) -> None:
        client = self._client()
        try:
            fields = await store(self.gw, client).batch_fields(batch_id)
            if fields is None or fields["status"] in ENDED:
                await client.at(client.gkeys.batches_active).srem(client.gkeys.batches_active, batch_id)
                return
            run = BatchLines(self, self._client(fields["_key_hash"]), batch_id, fields)
            await run.run()
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - its lease is released: a later scan takes it up again
            log.exception("batch %s: its driver stopped", batch_id)
        finally:
            key = client.gkeys.batch(batch_id).lease
            with contextlib.suppress(Exception):
                if await client.at(key).get(key) == self.token.encode():
                    await client.at(key).delete(key)


class BatchLines:
    """One driver's run of one batch, until it ends or the lease is lost."""

    QUOTA_RECHECK_S = 60.0  # a creator over its quota is asked again this often, not only at the reset

    def __init__(self, driver: BatchDriver, client: AsyncClient, batch_id: str, fields: dict):
        self.driver, self.client, self.batch_id, self.fields = driver, client, batch_id, fields
        self.keys = client.gkeys.batch(batch_id)
        self.store = store(driver.gw, client)
        self.inflight: dict[str, Line] = {}  # job id -> its line
        self.prefix = f"openai-batch:{batch_id}"
        self.lines: list[tuple[int, dict]] = []  # (line number, request line) of the input file
        self.quota_until = 0.0  # (monotonic) the creator's key is over its daily token quota until then

    async def run(self) -> None:
        content = await self.store.content(None, self.fields["input_file_id"])
        if content is None:
            await self._fail("the input file was deleted before the batch ran")
            return
        r = self.client.at(self.keys.results)
        done = {int(n) for n in await r.hkeys(self.keys.results)}
        self.lines = await asyncio.to_thread(request_lines, content)  # (off the event loop: a big file)
        todo = deque((n, item) for n, item in self.lines if n not in done)
        if self.fields["status"] == "validating":
            await self.store.update_batch(self.batch_id, status="in_progress", in_progress_at=int(time.time()))
        cancelling = False
        window = self.driver.gw.settings.batch_window
        renewed = time.monotonic()
        while True:
            if time.monotonic() - renewed > self.driver.LEASE_S / 3:
                if not await self.driver._renew(self.client, self.batch_id):
                    log.warning("batch %s: lease lost; another gateway runs it", self.batch_id)
                    return
                renewed = time.monotonic()
            status, expires_at = await self._status()
            if not cancelling and status == "cancelling":
                cancelling = True
                todo.clear()
                await self._cancel_jobs(done)
            if not cancelling and expires_at is not None and time.time() >= expires_at:
                await self._expire(done)
                return
            while todo and len(self.inflight) < window and time.monotonic() >= self.quota_until:
                if not await self._submit(*todo[0]):
                    break  # the queue is full (or the key over quota): this line again at the next poll
                    # (or once the quota resets), the lease renewed meanwhile
                todo.popleft()
            if self.inflight:
                await self._reap()
            if not todo and not self.inflight:
                await self._finish("cancelled" if cancelling else "completed")
                return
            await asyncio.sleep(self.driver.POLL_S)

    async def _status(self) -> tuple[str, Optional[int]]:
        """(status, expires_at), read at each poll: a cancel, or the window's end, may come any time."""
        raw = await self.client.at(self.keys.meta).hmget(self.keys.meta, ["status", "expires_at"])
        return json.loads(raw[0]), json.loads(raw[1]) if raw[1] is not None else None

    async def _submit(self, n: int, item: dict) -> bool:
        """The line queued (or answered, when it cannot run); False when the queue is full."""
        custom_id = item["custom_id"]
        try:
            params, fallback, _, kind, top_n = _line_params(item)
            sub = await arun_steps(bulk_submit({**fallback, **params}, BULK_TIER_FLOOR,
                                               self.client.settings.max_prompt_bytes, f"{self.prefix}:{custom_id}"),
                                   _async_io(self.client))
        except OverloadError:
            return False
        except QuotaExceeded as exc:  # the creator's key: the batch waits for the next UTC day, not failing
            if not self.quota_until:
                log.info("batch %s: %s; its lines wait", self.batch_id, exc)
            self.quota_until = time.monotonic() + min(exc.retry_after_s, self.QUOTA_RECHECK_S)
            return False
        except ValueError as exc:  # (checked at create: a model gone since, say)
            await self._write(n, refused_line(n, custom_id, f"invalid request: {exc}"))
            return True
        await self.client.at(self.keys.jobs).hset(self.keys.jobs, n, f"{sub.model} {sub.job_id}")
        self.inflight[sub.job_id] = Line(n, custom_id, kind, top_n, sub)
        return True

    async def _reap(self, expiring: bool = False) -> None:
        """Write the lines whose jobs have ended (``expiring``: those cancelled by the expiry are left to it)."""
        ended = await arun_steps(reap_lines(self.inflight, self.client.gkeys), _async_io(self.client))
        for line, job_id, res in ended:
            if expiring and res.finish_reason == "cancelled":
                continue
            fmt = None
            if line.top_n > 0 or any(o.logprobs is not None for o in res.outputs):
                info = await self.client.model_info(line.sub.model)  # (its tokenizer.json read off the event loop)
                names = await asyncio.to_thread(self.driver.gw.token_names.for_model, info)
                fmt = LogprobFormatter(names, max(line.top_n, 0))
            await self._write(line.n, batch_line(line.n, line.custom_id, job_id, line.sub.model, line.kind, res, fmt))

    async def _cancel_jobs(self, done: set[int]) -> None:
        """Cancel the batch's jobs not yet answered, this driver's and any an earlier one queued."""
        queued = {line.n for line in self.inflight.values()}
        ids = {n: item["custom_id"] for n, item in self.lines}
        kind = KINDS[self.fields["endpoint"]]
        jobs = await self.client.at(self.keys.jobs).hgetall(self.keys.jobs)
        for raw_n, raw in jobs.items():
            n, (model, job_id) = int(raw_n), raw.decode().split(" ", 1)
            if n not in done and n not in queued:  # queued by an earlier driver
                self.inflight[job_id] = Line(n, ids.get(n), kind, 0, Submitted(model, job_id, True))
        for job_id, line in list(self.inflight.items()):
            with contextlib.suppress(Exception):  # one that ended meanwhile is answered as it ended
                await self.client._cancel(line.sub.model, job_id)

    async def _expire(self, done: set[int]) -> None:
        """Past its window: cancel its jobs (those queued never run), keep the lines answered by then, and
        answer every other line with OpenAI's ``batch_expired`` error."""
        log.info("batch %s: its completion window has passed; it expires", self.batch_id)
        await self._cancel_jobs(done)
        await self._reap(expiring=True)
        answered = {int(n) for n in await self.client.at(self.keys.results).hkeys(self.keys.results)}
        left = [(n, refused_line(n, item["custom_id"], "This request could not be executed before the completion "
                                 "window expired.", code="batch_expired")) for n, item in self.lines if n not in answered]
        for i in range(0, len(left), 1000):  # (a transaction per thousand lines, not per line)
            await self._write_many(left[i:i + 1000])
        await self._finish("expired")

    async def _write(self, n: int, line: dict) -> None:
        await self._write_many([(n, line)])

    async def _write_many(self, answers: list[tuple[int, dict]]) -> None:
        """Lines' answers, each once: a line and, for an error, its mark, in one transaction."""
        k = self.keys
        async with self.client.at(k.results).pipeline(transaction=True) as pipe:
            for n, line in answers:
                line.pop("line", None)  # (mlxq batch's own field: OpenAI's lines have none)
                if line.get("id"):
                    line["id"] = f"batch_req_{line['id']}"
                pipe.hsetnx(k.results, n, json.dumps(line, ensure_ascii=False))
                if line["response"] is None or line["response"]["status_code"] != 200:
                    pipe.hsetnx(k.failed, n, 1)
            await pipe.execute()

    async def _finish(self, end: str) -> None:
        """The output and error files, in the input's order, and the batch's end (``end``: completed,
        cancelled or expired)."""
        k = self.keys
        raw = await self.client.at(k.results).hgetall(k.results)
        failed = {int(n) for n in await self.client.at(k.failed).hkeys(k.failed)}
        lines = sorted((int(n), v.decode()) for n, v in raw.items())
        out = [v for n, v in lines if n not in failed]
        err = [v for n, v in lines if n in failed]
        owner_ = self.fields["_owner"]
        now = int(time.time())
        ids = {}
        for name, part in (("output", out), ("error", err)):
            if part:
                obj = await self.store.put_file(owner_, f"{self.batch_id}_{name}.jsonl", f"batch_{name}",
                                                ("\n".join(part) + "\n").encode(), file_id=f"file-{self.batch_id}-{name}")
                ids[name] = obj["id"]
        await self._announce(end, len(out), len(err), output_file_id=ids.get("output"), error_file_id=ids.get("error"))
        await self.store.update_batch(self.batch_id, status=end, finalizing_at=now, **{f"{end}_at": now},
                                      output_file_id=ids.get("output"), error_file_id=ids.get("error"),
                                      request_counts={"total": self.fields["request_counts"]["total"],
                                                      "completed": len(out), "failed": len(err)})
        await self._forget()
        log.info("batch %s %s: %d answered, %d failed", self.batch_id, end, len(out), len(err))

    async def _announce(self, status: str, completed: int, failed: int, **files) -> None:
        """The batch's webhook, if it named one, queued for the webhook sender before the batch is marked
        ended: a driver gone between the two ends the batch again, and queues it again (at least once)."""
        url = self.fields.get("_webhook")
        if url:
            hook = RunWebhook("batch", url, self.batch_id)
            hook.completed, hook.failed = completed, failed
            await arun_steps(hook.end(status, self.client.gkeys, self.fields["_key_hash"],
                                      self.fields["request_counts"]["total"], **files), _async_io(self.client))

    async def _fail(self, why: str) -> None:
        await self._announce("failed", 0, 0, output_file_id=None, error_file_id=None)
        await self.store.update_batch(self.batch_id, status="failed", failed_at=int(time.time()),
                                      errors={"object": "list", "data": [{"code": "invalid_file", "message": why,
                                                                          "param": None, "line": None}]})
        await self._forget()

    async def _forget(self) -> None:
        k = self.keys
        await self.client.at(k.results).delete(k.results, k.failed, k.jobs)
        active = self.client.gkeys.batches_active
        await self.client.at(active).srem(active, self.batch_id)

