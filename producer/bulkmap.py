"""``Client.map`` and what ``mlxq batch`` shares with it: submitting at the low tier with no
subscription per job (bulk callers wait by polling job records), backing off while the queue is full."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Optional

from ..shared.genopts import check_defaults, error_text
from ..shared.protocol import OverloadError
from ..shared.schemas import Result
from .common import NoModelError, known_model
from .core import MAX_RESUBMITS, Origin, prepare

log = logging.getLogger(__name__)

BULK_TIER_FLOOR = "low"
OVERLOAD_BACKOFF_S = 0.5


@dataclass
class Submitted:
    model: str
    job_id: str
    duplicate: bool
    schema: Any = None  # the pydantic class of ``response_format=``, if one was given
    origin: Optional[Origin] = None  # to submit it again if a failover loses its record
    resubmits: int = 0

    def again(self, client) -> "Submitted":
        """The job submitted again, its record lost (a write lost with a failed master): under the
        same idempotency key, so every reader of this lost job lands on one new job. ValueError
        past ``MAX_RESUBMITS``: a record lost that often was not lost to a failover."""
        if self.origin is None or self.resubmits >= MAX_RESUBMITS:
            raise ValueError(f"job {self.job_id}: its record in Redis is gone, and it cannot be submitted again")
        job_id, payload = self.origin.again(None)
        enq = client.queue_for(self.model).enqueue(job_id, payload, client.key_hash, self.origin.floor,
                                                   self.origin.idempotency_key, global_redis=client.redis)
        log.warning("job=%s attempt=0 record lost (a failover?): submitted again as job=%s", self.job_id, enq.job_id)
        return Submitted(self.model, enq.job_id, False, self.schema, self.origin, self.resubmits + 1)


def enqueue_request(client, params: dict, tier: str, idempotency_key: Optional[str] = None,
                    source: str = "bulk") -> Submitted:
    """Validate and enqueue one request without holding a channel subscription per job
    (bulk callers wait by polling job records).  ValueError: invalid (NoModelError, a ValueError here:
    a model no worker ever registered, which would wait forever); OverloadError: queue full."""
    params = dict(params)
    model = params.pop("model", None) or client.model
    try:
        info = known_model(model, client._registry())
    except NoModelError as exc:
        raise ValueError(str(exc)) from None
    prep = prepare(model, {**params, "source": source, "submitted_at": time.time()}, info,
                   client.settings.max_prompt_bytes)
    # ``tier`` is a floor: the tier itself is decided in Redis from the client's key
    enq = client.queue_for(model).enqueue(prep.request.id, prep.payload, client.key_hash, tier, idempotency_key,
                                          global_redis=client.redis)
    return Submitted(model, enq.job_id, enq.status == "duplicate", prep.schema, Origin.of(prep, tier, idempotency_key))


def as_params(item: Any) -> dict:
    if isinstance(item, str):
        return {"prompt": item}
    if isinstance(item, dict):
        return dict(item)
    raise ValueError(f"expected a prompt string or an object of submit arguments, got {type(item).__name__}")


def submit_with_backoff(client, params: dict, tier: str, key: Optional[str],
                        stop: Optional[threading.Event]) -> Optional[Submitted]:
    """``enqueue_request``, again every ``OVERLOAD_BACKOFF_S`` while the queue is full; None once
    ``stop`` is set."""
    while True:
        try:
            return enqueue_request(client, params, tier, key)
        except OverloadError as exc:
            log.info("queue full, retrying in %.1fs: %s", OVERLOAD_BACKOFF_S, exc)
            if stop is not None and stop.wait(OVERLOAD_BACKOFF_S):
                return None
            if stop is None:
                time.sleep(OVERLOAD_BACKOFF_S)


def map_results(client, items: Iterable[Any], *, window: int = 64, timeout: Optional[float] = None,
                idempotency_prefix: Optional[str] = None, **params: Any) -> Iterator[Result]:
    """Submit each item (a prompt or a dict of submit arguments; ``params`` are defaults) at the
    low tier, keeping up to ``window`` jobs queued; yield Results in input order.  An invalid item
    yields a Result with ``finish_reason="error"`` rather than stopping the iteration; invalid
    ``params`` raise ValueError before anything is queued.  Left before its end (a break, an error),
    its jobs still queued are cancelled, unless an ``idempotency_prefix`` lets a later call find them."""
    if window < 1:
        raise ValueError(f"window must be at least 1, got {window}")
    check_defaults(params)
    tier = client.tier(BULK_TIER_FLOOR)
    it = enumerate(items)
    inflight: deque = deque()  # (index, Submitted | Result)
    exhausted = False
    try:
        while True:
            while not exhausted and len(inflight) < window:
                try:
                    i, item = next(it)
                except StopIteration:
                    exhausted = True
                    break
                key = f"{idempotency_prefix}:{i}" if idempotency_prefix else None
                try:
                    inflight.append((i, submit_with_backoff(client, {**params, **as_params(item)}, tier, key, None)))
                except ValueError as exc:
                    inflight.append((i, Result(id="", finish_reason="error",
                                               error=f"invalid request: {error_text(exc)}")))
            if not inflight:
                return
            _, sub = inflight[0]
            res = (sub if isinstance(sub, Result)
                   else client.job(sub.job_id, sub.model, sub.schema, _origin=sub.origin).result(timeout=timeout))
            inflight.popleft()
            yield res
    finally:
        if inflight and not idempotency_prefix:  # nobody can find these jobs again: they would run for nobody
            _cancel_all(client, [sub for _, sub in inflight if isinstance(sub, Submitted)])


def _cancel_all(client, subs: list) -> None:
    for sub in subs:
        try:
            client.queue_for(sub.model).cancel(sub.job_id)
        except Exception as exc:  # noqa: BLE001 - best effort: the caller's own exception matters more
            log.warning("job=%s: cancelling it after map() stopped failed: %s", sub.job_id, exc)
