"""``Client.map``, ``AsyncClient.map`` and what ``mlxq batch`` shares with them: submitting at the low
tier with no subscription per job (bulk callers wait by polling job records), backing off while the
queue is full.

As in ``mlxq.producer.core``, the decisions are written once, as generators that yield the I/O they
need (``MapCore.steps``, ``bulk_submit``); ``map_results`` does that I/O with a ``Client``,
``amap_results`` awaits it with an ``AsyncClient``."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque
from dataclasses import dataclass
from typing import Any, AsyncIterator, Iterable, Iterator, Optional

from ..shared.genopts import check_defaults, error_text
from ..shared.protocol import OverloadError, QuotaExceeded
from ..shared.schemas import Result
from ..shared.steps import Step, Steps, adrive, arun_steps, drive, run_steps
from .errors import NoModelError
from .registry import known_model
from .core import MAX_RESUBMITS, Enqueue, Origin, prepare
from .records import result_from_hash
from .webhooks import bulk_summary, bulk_webhook_writes, check_url

log = logging.getLogger(__name__)

BULK_TIER_FLOOR = "low"
OVERLOAD_BACKOFF_S = 0.5
# a key over its daily token quota: a bulk run waits for a reset this near (the UTC day about to turn);
# one further off ends the run with the QuotaExceeded, which says when the quota resets
QUOTA_WAIT_MAX_S = 60.0


@dataclass
class Submitted:
    model: str
    job_id: str
    duplicate: bool
    schema: Any = None  # the pydantic class of ``response_format=``, if one was given
    origin: Optional[Origin] = None  # to submit it again if a failover loses its record
    resubmits: int = 0

    def again(self, client) -> "Submitted":
        """``again_steps`` with a ``Client``."""
        return run_steps(self.again_steps(), _sync_io(client))

    def again_steps(self) -> Step:
        """The job submitted again, its record lost (a write lost with a failed master): under the
        same idempotency key, so every reader of this lost job lands on one new job. ValueError
        past ``MAX_RESUBMITS``: a record lost that often was not lost to a failover."""
        if self.origin is None or self.resubmits >= MAX_RESUBMITS:
            raise ValueError(f"job {self.job_id}: its record in Redis is gone, and it cannot be submitted again")
        job_id, payload = self.origin.again(None)
        enq = yield Enqueue(self.model, job_id, payload, self.origin.floor, self.origin.idempotency_key)
        log.warning("job=%s attempt=0 record lost (a failover?): submitted again as job=%s", self.job_id, enq.job_id)
        return Submitted(self.model, enq.job_id, False, self.schema, self.origin, self.resubmits + 1)


# -- the requests for I/O (with core.Enqueue) ---------------------------------------------------------

@dataclass(frozen=True)
class PickModel:
    """Reply: the client's default model (``Client.model``)."""


@dataclass(frozen=True)
class ReadRegistry:
    """Reply: the workers' model registry, None when this Redis user may not read it."""


@dataclass(frozen=True)
class Tier:
    """Reply: the tier the client's key gets, lowered to ``floor`` (``Client.tier``)."""
    floor: str


@dataclass(frozen=True)
class Sleep:
    seconds: float


@dataclass(frozen=True)
class WaitResult:
    """Reply: the final ``Result`` of the job ``sub``, waited for up to ``timeout``."""
    sub: Submitted
    timeout: Optional[float]


@dataclass(frozen=True)
class Cancel:
    """Cancel the job ``sub`` (reply ignored)."""
    sub: Submitted


@dataclass(frozen=True)
class Yield:
    """Hand ``result`` to the caller of ``map`` (no I/O)."""
    result: Result


@dataclass(frozen=True)
class ReadRecords:
    """Reply: the record hash of each job (``keys``: the job hashes' keys), {} for one that is gone."""
    keys: tuple


@dataclass(frozen=True)
class QueueWebhook:
    """Reply: None, once a bulk run's webhook is queued for the sender (``writes``: ``bulk_webhook_writes``)."""
    writes: list


PICK_MODEL, READ_REGISTRY = PickModel(), ReadRegistry()


class RunWebhook:
    """A bulk run's webhook: one message when the whole run ends (what a pipeline waits for), not one
    per job.  ``end`` queues ``<kind>.<status>`` with the run's ``request_counts`` (``completed``: the
    lines answered, ``failed``: those that ended in an error) for the webhook sender."""

    def __init__(self, kind: str, url: str, run_id: Optional[str] = None):
        self.kind, self.url = kind, url
        self.id = run_id or f"{kind}_{uuid.uuid4().hex}"
        self.completed = self.failed = 0

    def count(self, res: Result) -> None:
        if res.finish_reason == "error":
            self.failed += 1
        else:
            self.completed += 1

    def end(self, status: str, gkeys, key_hash: Optional[str], total: Optional[int] = None, **extra) -> Step:
        counts = {"total": self.completed + self.failed if total is None else total, "completed": self.completed,
                  "failed": self.failed}
        message = bulk_summary(self.kind, self.id, status, counts, **extra)
        yield QueueWebhook(bulk_webhook_writes(gkeys, self.id, self.url, key_hash, message))


@dataclass
class Line:
    """A line of a bulk run (``mlxq batch``, an OpenAI batch) whose job is in flight."""
    n: int  # its line number in the input
    custom_id: Optional[str]
    kind: str  # bulk.Kind: "chat", "text" or "embed" (a chat.completion, a text_completion, embeddings)
    top_n: int  # the top logprobs shown (-1: the line's own ``logprobs``)
    sub: Submitted


def reap_lines(inflight: dict[str, Line], gkeys) -> Step:
    """Read the records of the jobs in ``inflight`` (job id -> ``Line``; ``gkeys``: the client's
    ``GlobalKeys``) and take out the lines whose job ended: returns [(line, job id, ``Result``)].  A
    job whose record is gone (a write lost with a failed master) is submitted again under its
    idempotency key (``Submitted.again_steps``) and stays in flight under its new id; one that cannot
    be comes back as a failed ``Result`` (``error_code`` ``record_lost``)."""
    ids = list(inflight)
    hashes = yield ReadRecords(tuple(gkeys.model_keys(inflight[i].sub.model).job(i) for i in ids))
    ended = []
    for job_id, h in zip(ids, hashes):
        if h:
            res = result_from_hash(job_id, h)
            if res is not None:
                ended.append((inflight.pop(job_id), job_id, res))
            continue
        line = inflight.pop(job_id)
        try:
            sub = yield from line.sub.again_steps()
        except (OverloadError, QuotaExceeded):  # the queue is full, the key over quota: again at the next read
            inflight[job_id] = line
            continue
        except ValueError as exc:
            ended.append((line, job_id, Result(id=job_id, finish_reason="error", error=str(exc),
                                               error_code="record_lost")))
            continue
        line.sub = sub
        inflight[sub.job_id] = line
    return ended


def bulk_submit(params: dict, tier: str, max_bytes: int, idempotency_key: Optional[str] = None,
                source: str = "bulk") -> Step:
    """Validate and enqueue one request without holding a channel subscription per job (bulk callers
    wait by polling job records); returns ``Submitted``.  ValueError: invalid (NoModelError, a
    ValueError here: a model no worker ever registered, which would wait forever); OverloadError:
    queue full.  ``tier`` is a floor: the tier itself is decided in Redis from the client's key."""
    params = dict(params)
    model = params.pop("model", None) or (yield PICK_MODEL)
    try:
        info = known_model(model, (yield READ_REGISTRY))
    except NoModelError as exc:
        raise ValueError(str(exc)) from None
    prep = prepare(model, {**params, "source": source, "submitted_at": time.time()}, info, max_bytes)
    enq = yield Enqueue(model, prep.request.id, prep.payload, tier, idempotency_key)
    return Submitted(model, enq.job_id, enq.status == "duplicate", prep.schema, Origin.of(prep, tier, idempotency_key))


def bulk_submit_patiently(params: dict, tier: str, max_bytes: int, idempotency_key: Optional[str]) -> Step:
    """``bulk_submit``, again every ``OVERLOAD_BACKOFF_S`` while the queue is full, and again at the
    quota's reset when the key's daily token quota resets within ``QUOTA_WAIT_MAX_S`` (QuotaExceeded
    when it resets later)."""
    while True:
        try:
            return (yield from bulk_submit(params, tier, max_bytes, idempotency_key))
        except OverloadError as exc:
            log.info("queue full, retrying in %.1fs: %s", OVERLOAD_BACKOFF_S, exc)
            yield Sleep(OVERLOAD_BACKOFF_S)
        except QuotaExceeded as exc:
            if exc.retry_after_s >= QUOTA_WAIT_MAX_S:
                raise
            log.info("daily token quota used up, retrying in %.0fs, when it resets", exc.retry_after_s)
            yield Sleep(exc.retry_after_s)


def as_params(item: Any) -> dict:
    if isinstance(item, str):
        return {"prompt": item}
    if isinstance(item, dict):
        return dict(item)
    raise ValueError(f"expected a prompt string or an object of submit arguments, got {type(item).__name__}")


class MapCore:
    """One ``map``: submit each item (a prompt or a dict of submit arguments; ``params`` are defaults)
    at the low tier, keeping up to ``window`` jobs queued; hand out Results in input order.  An invalid
    item gives a Result with ``finish_reason="error"`` rather than stopping the iteration; invalid
    ``params`` raise ValueError before anything is queued.  Left before its end (a break, an error),
    its driver runs ``cancel_unfinished``."""

    def __init__(self, items: Iterable[Any], window: int, timeout: Optional[float],
                 idempotency_prefix: Optional[str], params: dict, max_bytes: int):
        self.items, self.window, self.timeout = items, window, timeout
        self.prefix, self.params, self.max_bytes = idempotency_prefix, params, max_bytes
        self.inflight: deque = deque()  # (index, Submitted | Result)

    def cancel_unfinished(self) -> Step:
        """Cancel the jobs still queued when the caller left early, which nobody could find again (they
        would run for nobody); none when an ``idempotency_prefix`` lets a later call find them.  Best
        effort: a cancel that fails is logged, the caller's own exception matters more."""
        if self.prefix:
            return
        for sub in [sub for _, sub in self.inflight if isinstance(sub, Submitted)]:
            try:
                yield Cancel(sub)
            except Exception as exc:  # noqa: BLE001
                log.warning("job=%s: cancelling it after map() stopped failed: %s", sub.job_id, exc)

    def steps(self) -> Step:
        if self.window < 1:
            raise ValueError(f"window must be at least 1, got {self.window}")
        check_defaults(self.params)
        tier = yield Tier(BULK_TIER_FLOOR)
        it = enumerate(self.items)
        exhausted = False
        while True:
            while not exhausted and len(self.inflight) < self.window:
                try:
                    i, item = next(it)
                except StopIteration:
                    exhausted = True
                    break
                key = f"{self.prefix}:{i}" if self.prefix else None
                try:
                    params = {**self.params, **as_params(item)}
                    self.inflight.append((i, (yield from bulk_submit_patiently(params, tier, self.max_bytes, key))))
                except ValueError as exc:
                    self.inflight.append((i, Result(id="", finish_reason="error",
                                                    error=f"invalid request: {error_text(exc)}")))
            if not self.inflight:
                return
            _, sub = self.inflight[0]
            res = sub if isinstance(sub, Result) else (yield WaitResult(sub, self.timeout))
            self.inflight.popleft()
            yield Yield(res)


# -- the sync client's I/O -------------------------------------------------------------------------------

def _sync_io(client, sleep=time.sleep):
    handlers = {PickModel: lambda op: client.model, ReadRegistry: lambda op: client._registry(),
                Enqueue: client._enqueue, Tier: lambda op: client.tier(op.floor), Sleep: lambda op: sleep(op.seconds),
                Cancel: lambda op: client._cancel(op.sub.model, op.sub.job_id),
                WaitResult: lambda op: client.job(op.sub.job_id, op.sub.model, op.sub.schema,
                                                  _origin=op.sub.origin).result(timeout=op.timeout),
                ReadRecords: lambda op: read_records(client.redis, op.keys),
                QueueWebhook: lambda op: [getattr(client.redis, cmd)(*args) for _, cmd, args in op.writes]}
    return lambda op: handlers[type(op)](op)


def read_records(r, keys) -> list:
    """``ReadRecords``: one pipeline (a cluster's client splits it by slot); awaitable with an asyncio client."""
    with_pipe = r.pipeline(transaction=False)
    for key in keys:
        with_pipe.hgetall(key)
    return with_pipe.execute()


def enqueue_request(client, params: dict, tier: str, idempotency_key: Optional[str] = None,
                    source: str = "bulk") -> Submitted:
    """``bulk_submit`` with a ``Client``."""
    return run_steps(bulk_submit(params, tier, client.settings.max_prompt_bytes, idempotency_key, source),
                     _sync_io(client))


class _Stopped(Exception):
    """The caller's stop event was set during a backoff."""


def submit_with_backoff(client, params: dict, tier: str, key: Optional[str], stop) -> Optional[Submitted]:
    """``bulk_submit_patiently`` with a ``Client``; None once ``stop`` (a ``threading.Event``) is set."""
    def sleep(seconds: float) -> None:
        if stop is None:
            time.sleep(seconds)
        elif stop.wait(seconds):
            raise _Stopped
    try:
        return run_steps(bulk_submit_patiently(params, tier, client.settings.max_prompt_bytes, key),
                         _sync_io(client, sleep))
    except _Stopped:
        return None


def map_results(client, items: Iterable[Any], *, window: int = 64, timeout: Optional[float] = None,
                idempotency_prefix: Optional[str] = None, webhook: Optional[str] = None,
                **params: Any) -> Iterator[Result]:
    """``MapCore`` with a ``Client`` (``Client.map``)."""
    core = MapCore(items, window, timeout, idempotency_prefix, params, client.settings.max_prompt_bytes)
    hook = None
    if webhook is not None:
        check_url(webhook, client.settings)
        hook = RunWebhook("map", webhook)
    do = _sync_io(client)
    status = "failed"
    try:
        for op in drive(Steps(core.steps()), do, Yield):
            if hook:
                hook.count(op.result)
            yield op.result
        status = "completed"
    except GeneratorExit:  # left before its end
        status = "cancelled"
        raise
    finally:
        run_steps(core.cancel_unfinished(), do)
        if hook:
            try:
                run_steps(hook.end(status, client.gkeys, client.key_hash), do)
            except Exception as exc:  # noqa: BLE001 - the caller's own exception matters more
                log.warning("map %s: its webhook was not queued: %s", hook.id, exc)


# -- the async client's I/O ------------------------------------------------------------------------------

def _async_io(client):
    async def queue_webhook(op: QueueWebhook) -> None:
        for key, cmd, args in op.writes:
            await getattr(client.at(key), cmd)(*args)

    async def wait_result(op: WaitResult) -> Result:
        job = await client.job(op.sub.job_id, op.sub.model, op.sub.schema, _origin=op.sub.origin)
        return await job.result(timeout=op.timeout)

    handlers = {PickModel: lambda op: client.model, ReadRegistry: lambda op: client._registry(),
                Enqueue: client._enqueue, Tier: lambda op: client.tier(op.floor),
                Sleep: lambda op: asyncio.sleep(op.seconds), WaitResult: wait_result,
                Cancel: lambda op: client._cancel(op.sub.model, op.sub.job_id),
                ReadRecords: lambda op: read_records(client.redis, op.keys), QueueWebhook: queue_webhook}
    return lambda op: handlers[type(op)](op)


async def amap_results(client, items: Iterable[Any], *, window: int = 64, timeout: Optional[float] = None,
                       idempotency_prefix: Optional[str] = None, webhook: Optional[str] = None,
                       **params: Any) -> AsyncIterator[Result]:
    """``MapCore`` with an ``AsyncClient`` (``AsyncClient.map``), each I/O awaited."""
    core = MapCore(items, window, timeout, idempotency_prefix, params, client.settings.max_prompt_bytes)
    hook = None
    if webhook is not None:
        await asyncio.to_thread(check_url, webhook, client.settings)  # (it resolves the host)
        hook = RunWebhook("map", webhook)
    do = _async_io(client)
    status = "failed"
    try:
        async for op in adrive(Steps(core.steps()), do, Yield):
            if hook:
                hook.count(op.result)
            yield op.result
        status = "completed"
    except GeneratorExit:
        status = "cancelled"
        raise
    finally:
        await arun_steps(core.cancel_unfinished(), do)
        if hook:
            try:
                await arun_steps(hook.end(status, client.gkeys, client.key_hash), do)
            except Exception as exc:  # noqa: BLE001 - the caller's own exception matters more
                log.warning("map %s: its webhook was not queued: %s", hook.id, exc)

