"""The client core: what ``Client`` and ``AsyncClient`` decide, written once.

The two clients only do I/O.  Everything they must agree on lives here, with no socket in sight:

- **requests**: ``prepare`` validates a submission, turns a pydantic ``response_format`` class into
  its JSON schema and packs the payload (the size limit included);
- **a job's two waits** (``JobCore.stream`` and ``JobCore.wait_result``) are generators that say
  which Redis read they need next (``Receive``, ``READ_EVENTS``, ``READ_RECORD``, ``WaitDone``), what
  to hand the caller (``Emit``) and when to back off (``Pause``).  Each job class runs them with
  one short loop (``Job._drive`` / ``AsyncJob._drive`` over ``Steps``) that does the read it is told
  (the method ``JobHandle._handlers`` maps the request's class to), with its own socket and its own
  way of waiting, and sends back the reply or throws in the error;
- **a submission** (``submission``): subscribe, enqueue, and drop the subscription on any way out;
- **retries**: which errors are a pause (``retryable``), the deadline and what is raised past it
  (``JobTimeout``, or ``RedisUnreachable`` while the links are down; with no deadline,
  ``RedisUnreachable`` once the client's ``LinkWatch`` has seen the links down for its give-up
  time, ``redis_outage_s``), and ``ClientClosed`` once the client is closed;
- **stream state**: what a live message or a record entry adds (``StreamState``), when to re-read
  the durable record (quiet, ``SYNC`` after a lost link, a gap);
- **structured results**: ``parsed`` and ``parse_error`` of a job submitted with a pydantic class;
- **embeddings**: ``embed``'s input as one job each (``embed_inputs``) and its answer from their
  results (``embed_answer``).

So both clients behave the same and raise the same errors; ``tests/producer/test_client_core.py`` runs one
set of assertions against both.
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

from pydantic import BaseModel, ValidationError
import redis
from redis.exceptions import NoScriptError

from ..shared import codec, replay
from ..shared.keys import ModelKeys
from ..shared.linkwatch import Backoff, LinkWatch, is_link_error
from ..shared.schemas import Delta, GenerateRequest, Parsed, Result, new_job_id
from ..shared.settings import Settings
from ..shared.slots import is_cluster
from ..shared.steps import Step
from .errors import ClientClosed, ConfirmCut, ContextLengthError, EmbeddingFailed, JobNotFound, JobTimeout
from .records import StreamState, entry_deltas, payload_deltas, result_from_hash
from .webhooks import WebhookRefused, check_url

log = logging.getLogger("mlxq.producer")

SYNC = b"sync"  # what a job's inbox gets when it must read its durable record (the link was lost)
WAIT_S = 1.0  # the longest single wait on a job's inbox or done list


def retryable(exc: BaseException) -> bool:
    """A pause, not a failure: a lost link, or a script the slot's new master has not cached yet
    (after a failover the cluster client may load it on the old set of masters first)."""
    return is_link_error(exc) or isinstance(exc, NoScriptError)


def deadline_of(timeout: Optional[float]) -> Optional[float]:
    return None if timeout is None else time.monotonic() + timeout


def time_left(deadline: Optional[float]) -> Optional[float]:
    """Seconds to ``deadline`` (at least 0.01: a wait of 0 may not even look), None for no deadline."""
    return None if deadline is None else max(0.01, deadline - time.monotonic())


def wait_s(deadline: Optional[float]) -> float:
    """How long one wait on a job's inbox or done list may take: ``WAIT_S``, less when the deadline
    comes sooner, so a timeout shorter than ``WAIT_S`` is honoured."""
    left = time_left(deadline)
    return WAIT_S if left is None else min(WAIT_S, left)


def check_deadline(watch: LinkWatch, deadline: Optional[float], message: str) -> None:
    """Past ``deadline``: ``RedisUnreachable`` naming the nodes while the links are down, else
    ``JobTimeout(message)``."""
    if deadline is not None and time.monotonic() > deadline:
        if watch.down:
            raise watch.unreachable()
        raise JobTimeout(message)


# -- requests --------------------------------------------------------------------------------------

@dataclass
class Prepared:
    """A validated submission: the request, its wire payload, and the pydantic class its text must
    validate against (``response_format=`` a class), if any."""

    request: GenerateRequest
    payload: bytes
    schema: Optional[type[BaseModel]] = None


def schema_format(cls: type[BaseModel]) -> dict:
    """The ``response_format`` of a pydantic class: its JSON schema, strict."""
    return {"type": "json_schema",
            "json_schema": {"name": cls.__name__, "schema": cls.model_json_schema(), "strict": True}}


def schema_of(response_format: Any) -> Optional[type[BaseModel]]:
    """The pydantic class of a ``response_format=`` argument (None for a dict or None)."""
    return response_format if isinstance(response_format, type) and issubclass(response_format, BaseModel) else None


def prepare(model: str, kwargs: dict[str, Any], info: Optional[dict], max_bytes: int,
            count_tokens=None, settings: Optional[Settings] = None) -> Prepared:
    """Validate a submission before anything reaches Redis: ValueError (pydantic's included) for a
    bad request, ``ContextLengthError`` for a prompt that can never fit, ``ValueError`` past
    ``max_bytes``, ``WebhookRefused`` (a ValueError) for a webhook URL ``settings`` does not allow
    (it may resolve the host: blocking).  ``info``: the model's registry entry (None: unchecked)."""
    kwargs = dict(kwargs)
    schema = schema_of(kwargs.get("response_format"))
    if schema is not None:
        kwargs["response_format"] = schema_format(schema)
    req = build_request(model, kwargs)
    if req.webhook is not None:
        if settings is None:
            raise WebhookRefused("webhook= is not taken on this path (Client.submit and the gateway take it; "
                                 "map takes one webhook= for the whole run)")
        check_url(req.webhook, settings)
    check_fits(req, info, count_tokens)
    payload = pack_request(req)
    if len(payload) > max_bytes:
        raise ValueError(f"request of {len(payload)} bytes exceeds the {max_bytes}-byte limit")
    return Prepared(req, payload, schema)


def build_request(model: str, kwargs: dict[str, Any]) -> GenerateRequest:
    """Validate a submission before anything reaches Redis (pydantic raises ValueError)."""
    if kwargs.get("id") is not None:  # ids are 128 random bits, never the caller's choice (guessable)
        raise ValueError("id= is not accepted: mlxq chooses job ids (128 random bits)")
    kwargs = life_times({k: v for k, v in kwargs.items() if v is not None}, time.time())
    return GenerateRequest.model_validate({"model": model, **kwargs})


def life_times(kwargs: dict[str, Any], now: float) -> dict[str, Any]:
    """``defer_s`` and ``expires_in`` (seconds from ``now``) as ``run_at`` and ``expires_at`` (epoch
    seconds); an expiry already past is refused here (ValueError, HTTP 400), before anything is queued
    (the enqueue script checks it again on the server's clock)."""
    kwargs = dict(kwargs)
    for rel, absolute in (("defer_s", "run_at"), ("expires_in", "expires_at")):
        if rel not in kwargs:
            continue
        if absolute in kwargs:
            raise ValueError(f"give {rel}= or {absolute}=, not both")
        v = kwargs.pop(rel)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0 or v == float("inf"):
            raise ValueError(f"{rel} must be a number of seconds, 0 or more, not {v!r:.40}")
        kwargs[absolute] = now + v
    for name in ("run_at", "expires_at"):
        v = kwargs.get(name)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
            raise ValueError(f"{name} must be a time in epoch seconds, not {v!r:.40}")
    if kwargs.get("expires_at") is not None and kwargs["expires_at"] <= now:
        raise ValueError(f"expires_at {kwargs['expires_at']:.3f} is already past (now is {now:.3f}): "
                         "the job could never run")
    return kwargs


def check_fits(req: GenerateRequest, info: Optional[dict], count_tokens=None) -> None:
    """Refuse at submit what the model's worker would refuse anyway (a ValueError, HTTP 400).

    The prompt's length: for ``prompt_tokens`` the count is exact; for text, ``count_tokens(text)``
    when the caller can tokenize (the gateway on the models' host), else ``bytes / longest token``,
    a lower bound, so nothing that could fit is refused.  Also ids outside the vocabulary and
    ``max_tokens`` above the workers' limit.
    """
    if not info:
        return
    if req.embed is not None:
        check_dimensions(req.embed.dimensions, info)
    limit = int(info.get("max_new_tokens") or 0)
    if limit and req.embed is None and req.max_tokens > limit:
        raise ValueError(f"max_tokens {req.max_tokens} exceeds the workers' limit of {limit}")
    vocab = int(info.get("vocab_size") or 0)
    if vocab and req.prompt_tokens is not None and any(t >= vocab for t in req.prompt_tokens):
        raise ValueError(f"prompt_tokens contains ids outside the vocabulary (size {vocab})")
    ctx = int(info.get("context_length") or 0)
    if not ctx:
        return
    if req.prompt_tokens is not None:
        n, what = len(req.prompt_tokens), "of"
    elif req.prompt is not None and count_tokens is not None:
        n, what = count_tokens(req.prompt), "of"
    else:
        text = req.prompt if req.prompt is not None else "".join(m.content for m in req.messages or [])
        n, what = len(text.encode()) // max(1, int(info.get("max_token_bytes") or 1)), "of at least"
    if n >= ctx + (req.embed is not None):  # an embedding's input may fill the context: nothing follows it
        raise ContextLengthError(f"prompt {what} {n} tokens can never fit the model's context of {ctx} tokens")
    if "max_tokens" in req.model_fields_set and n + req.max_tokens > ctx:  # n is exact or a lower bound
        has = f"at least {n}" if what != "of" else str(n)
        raise ContextLengthError(f"this model's context is {ctx} tokens; the prompt has {has} and max_tokens asks "
                                 f"for {req.max_tokens} more: lower max_tokens, or shorten the prompt")


def check_dimensions(dimensions: Optional[int], info: Optional[dict]) -> None:
    """An embedding's ``dimensions`` within the model's embedding size, where its registry entry says."""
    size = int((info or {}).get("embedding_size") or 0)
    if dimensions is not None and size and dimensions > size:
        raise ValueError(f"dimensions {dimensions} exceeds this model's embedding size of {size}")


def pack_request(req: GenerateRequest) -> bytes:
    """The request's wire form: the fields that differ from their defaults (a reader's
    ``GenerateRequest`` has the rest; the record a finished job keeps is that much smaller).  A
    max_tokens the caller gave goes on the wire even at its default: the worker ends a job without
    one at the model's context, where an explicit one that cannot fit is refused."""
    d = req.model_dump(mode="json", exclude_none=True, exclude_defaults=True)
    if "max_tokens" in req.model_fields_set:
        d["max_tokens"] = req.max_tokens
    return codec.pack(d)


# -- embeddings -------------------------------------------------------------------------------------

EmbedInput = Union[str, list[str], list[int], list[list[int]]]


def embed_inputs(input: EmbedInput) -> tuple[list[dict[str, Any]], bool]:
    """``embed``'s input as one job's input each (``prompt`` or ``prompt_tokens``), and whether it was
    one input (a string, or one list of token ids) rather than a list of them."""
    if isinstance(input, str) or (isinstance(input, list) and input and all(_is_id(t) for t in input)):
        items, single = [input], True
    elif isinstance(input, (list, tuple)) and input:
        items, single = list(input), False
    else:
        raise ValueError("input must be a string, a list of strings, a list of token ids, or a list of those, "
                         "not empty")
    out = []
    for i, item in enumerate(items):
        if isinstance(item, str) and item:
            out.append({"prompt": item})
        elif isinstance(item, list) and item and all(_is_id(t) for t in item):
            out.append({"prompt_tokens": item})
        else:
            raise ValueError(f"input[{i}] must be a non-empty string or a non-empty list of token ids")
    return out, single


def _is_id(t: Any) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


def embed_kwargs(dimensions: Optional[int], pooling: Optional[str], normalize: bool) -> dict[str, Any]:
    """The ``embed`` field of an embedding job's request (``GenerateRequest.embed``)."""
    return {"embed": {k: v for k, v in (("dimensions", dimensions), ("pooling", pooling),
                                        ("normalize", normalize)) if v is not None}}


def embed_jobs(model: str, input: EmbedInput, options: dict[str, Any], info: Optional[dict], max_bytes: int,
               count_tokens=None) -> tuple[list[dict[str, Any]], bool]:
    """Each input's ``submit`` arguments (``options``: ``embed_kwargs``'s), every one validated as
    ``prepare`` does before any is queued (one bad input refuses them all); and whether ``input`` was one."""
    items, single = embed_inputs(input)
    jobs = [{**item, **options} for item in items]
    for i, kw in enumerate(jobs):
        try:
            prepare(model, submit_kwargs(kw.get("prompt"), None, kw.get("prompt_tokens"), None, "client",
                                         {"embed": kw["embed"]}), info, max_bytes, count_tokens)
        except ContextLengthError as exc:
            raise ContextLengthError(f"input[{i}]: {exc}" if not single else f"input: {exc}") from None
    return jobs, single


def embedding_of(res: Result) -> list[float]:
    """An embedding job's vector; ``EmbeddingFailed`` when the job ended without one."""
    if res.embedding is None:
        raise EmbeddingFailed(res)
    return codec.unpack_vector(res.embedding)


def embed_answer(results: list[Result], single: bool) -> Union[list[float], list[list[float]]]:
    """``embed``'s answer: one vector for one input, else one per input in its order."""
    vectors = [embedding_of(r) for r in results]
    return vectors[0] if single else vectors


# -- a submission, as requests for I/O -------------------------------------------------------------

@dataclass(frozen=True)
class Subscribe:
    """Subscribe the new job's channel, confirmed, before the job exists (its first delta cannot be
    missed); reply ignored."""


@dataclass(frozen=True)
class Unsubscribe:
    """Drop the new job's subscription (nothing will come on it); reply ignored."""


@dataclass(frozen=True)
class Enqueue:
    """Enqueue the prepared request on ``model``'s queue (``Queue.enqueue``); reply: ``Enqueued``."""
    model: str
    job_id: str
    payload: bytes
    floor: Optional[str]
    idempotency_key: Optional[str]


SUBSCRIBE, UNSUBSCRIBE = Subscribe(), Unsubscribe()


def submission(model: str, prep: Prepared, floor: Optional[str], idempotency_key: Optional[str],
               subscribe: bool) -> Step:
    """``submit``'s I/O once the request is prepared: subscribe (unless ``subscribe`` is False: bulk
    callers read the record), then enqueue under the request's own id (a retry after a lost reply is
    the same job).  Returns ``Enqueued``; a duplicate (the idempotency key matched an earlier job) keeps
    no subscription.  Whatever stops it, a cancel of the caller's task too, leaves no channel
    subscribed: the clients throw in every exception, ``BaseException`` included."""
    try:
        if subscribe:
            yield SUBSCRIBE
        enq = yield Enqueue(model, prep.request.id, prep.payload, floor, idempotency_key)
    except BaseException:
        yield UNSUBSCRIBE
        raise
    if enq.status == "duplicate":
        yield UNSUBSCRIBE
    return enq


# -- a job lost in a failover ------------------------------------------------------------------------

MAX_RESUBMITS = 3  # per handle: a record lost this often is not a failover's write window


@dataclass(frozen=True)
class Origin:
    """What the handle that submitted a job keeps to submit it again if its record is lost: the
    request, its tier floor, and the idempotency key (the caller's, else one made from the first id,
    so that every handle resubmitting the same lost job lands on one new job)."""

    request: GenerateRequest
    floor: Optional[str]
    idempotency_key: str

    @classmethod
    def of(cls, prep: "Prepared", floor: Optional[str], idempotency_key: Optional[str]) -> "Origin":
        return cls(prep.request, floor, idempotency_key or f"mlxq-resubmit:{prep.request.id}")

    def again(self, resume_ids: Optional[list[int]]) -> tuple[str, bytes]:
        """A new job id and the request to submit under it, carrying ``resume_ids``: the token ids
        the caller has already (the worker takes them as published output)."""
        req = self.request.model_copy(update={"id": new_job_id(), "resume_ids": resume_ids or None,
                                              "submitted_at": time.time()})
        return req.id, pack_request(req)


# -- structured results ----------------------------------------------------------------------------

class ParsedResult(Parsed, Result):
    """A ``Result`` of a job submitted with ``response_format=`` a pydantic class: ``parsed`` is the
    validated instance, or None with ``parse_error`` saying why (neither is serialized)."""


def with_parsed(res: Result, schema: Optional[type[BaseModel]]) -> Result:
    """``res`` as a ``ParsedResult`` when the job asked for ``schema`` (else ``res`` itself); each of a
    job's ``samples`` gets its own ``parsed`` / ``parse_error``."""
    if schema is None:
        return res
    out = ParsedResult.model_validate(res.model_dump())
    for target in (out, *(out.samples or ())):
        target._parsed, target._parse_error = parse_text(target, schema)
    return out


def parse_text(out, schema: type[BaseModel]) -> tuple[Any, Optional[str]]:
    """(the instance, None), or (None, why) for an output (a Result or one of its samples)."""
    if out.finish_reason == "error":
        return None, f"the job failed: {out.error}"
    try:
        return schema.model_validate_json(out.text), None
    except ValidationError as exc:
        return None, f"the text does not validate as {schema.__name__}: {exc}"


# -- a job's waits, as requests for I/O ---------------------------------------------------------------
# One class per request: ``JobHandle._handlers`` maps each class to the method of ``Job`` or ``AsyncJob``
# that does it.

@dataclass(frozen=True)
class ReadEvents:
    """Reply: the event-stream entries after ``JobCore.last_id`` (XRANGE)."""


@dataclass(frozen=True)
class ReadRecord:
    """Reply: the job's hash (HGETALL)."""


@dataclass(frozen=True)
class ReadReplay:
    """Reply: the job hash's ``REPLAY_FIELDS`` (HMGET)."""


READ_EVENTS, READ_RECORD, READ_REPLAY = ReadEvents(), ReadRecord(), ReadReplay()
# a finished job's compacted stream, the result it slices, and the status every job record has (none:
# no record, so one read tells both)
REPLAY_FIELDS = (replay.FIELD, "result", "status")


@dataclass(frozen=True)
class Receive:
    """The next live message, waited for up to ``seconds`` (reply: None after that, quiet); when not
    subscribed, subscribe first (its confirmation waited for at most ``confirm_s``, None: the
    subscriber's own limit) and reply ``SYNC`` to re-read the record."""
    seconds: float
    confirm_s: Optional[float]


@dataclass(frozen=True)
class WaitDone:
    """Wait up to ``seconds`` on the job's done list (reply ignored)."""
    seconds: float


@dataclass(frozen=True)
class Pause:
    """A failed read: ``LinkWatch.backoff`` with ``retryable`` (re-raises what is not a pause, gives
    up past ``deadline``, sleeps what ``backoff`` draws); reply ignored."""
    error: Exception
    deadline: Optional[float]
    backoff: Backoff


@dataclass(frozen=True)
class Emit:
    """Deltas for the caller of ``stream()``: the drivers hand out ``JobCore.undelivered`` one at a
    time (no I/O). What a caller that left early did not take stays there for its next ``stream()``."""


@dataclass(frozen=True)
class Resubmit:
    """The job's record is gone (a write lost with a failed master): submit it again (``Origin``) with
    ``resume_ids``, the token ids its caller has (None: from the start); reply: the new job's id."""
    resume_ids: Optional[list[int]]


EMIT = Emit()


class JobCore:
    """One job's reading state and the decisions of its waits (see the module's docstring)."""

    def __init__(self, job_id: str, keys: ModelKeys, watch: LinkWatch,
                 schema: Optional[type[BaseModel]] = None, closed: Callable[[], bool] = lambda: False,
                 origin: Optional[Origin] = None):
        self.id = job_id
        self.origin = origin  # the handle that submitted the job can submit it again (None: it cannot)
        self.resubmits = 0
        self.state = StreamState()
        if origin is not None and origin.request.resume_ids:  # the caller has these: the output goes on after them
            lane = self.state.lane(0)
            lane.ids, lane.chars_unknown = list(origin.request.resume_ids), True
        self.keys = keys
        self.watch = watch
        self.schema = schema
        self.closed = closed  # whether the client was closed (close() / aclose())
        self.last_id = "0-0"
        self.result: Optional[Result] = None
        # deltas read (the stream state already past them) but not yet handed to a caller: a stream()
        # left after its first delta of a batch, or a read that failed after a live message was fed
        # (a gap, n > 1), lost the rest before
        self.undelivered: collections.deque = collections.deque()

    def replay_from(self) -> str:
        """XRANGE's ``min`` for the entries not read yet."""
        return f"({self.last_id}" if self.last_id != "0-0" else "-"

    def feed_record(self, entries) -> list[Delta]:
        """The deltas the durable record's ``entries`` (XRANGE's reply) add."""
        out: list[Delta] = []
        for entry_id, fields in entries:
            self.last_id = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
            out.extend(self.state.feed_all(entry_deltas(fields)))
        return out

    def feed_replay(self, reply) -> list[Delta]:
        """The deltas a finished job's compacted stream adds (``READ_REPLAY``'s reply); none while the
        job has a stream.  A record that cannot be expanded raises ``ReplayError``: its stream is gone."""
        packed, result = reply[:2]
        out: list[Delta] = []
        if packed and result:
            for payload in replay.expand(packed, result):
                out.extend(self.state.feed_all([Delta.from_wire(w) for w in payload]))
        return out

    def stream(self, timeout: Optional[float]) -> Step:
        """Deltas in order, each once (emitted), until the job ends."""
        if self.undelivered:  # what an earlier stream() read and did not hand out
            yield EMIT
        yield from self._until(self._next_batch, lambda: self.state.done, timeout)

    def wait_result(self, timeout: Optional[float]) -> Step:
        """The final result, read from the job's hash; waits on its done list in between."""
        yield from self._until(self._poll_result, lambda: self.result is not None, timeout)
        return self.result

    def _until(self, attempt, finished, timeout: Optional[float]) -> Step:
        """``attempt`` until ``finished()``: a lost link is a pause (backoff), within ``timeout``."""
        deadline = deadline_of(timeout)
        late = f"job {self.id} did not finish within {timeout}s"
        backoff = self.watch.new_backoff()
        while not finished():
            self._check_open()
            check_deadline(self.watch, deadline, late)
            try:
                out = yield from attempt(deadline)
            except Exception as exc:
                self._check_open(exc)  # what a read fails with once its socket was closed under it
                if isinstance(exc, ConfirmCut):  # a wait the deadline cut short is no lost link
                    check_deadline(self.watch, deadline, late)
                yield Pause(exc, deadline, backoff)
                continue
            backoff.ok()
            self.watch.ok()
            self.undelivered.extend(out)
            if self.undelivered:
                yield EMIT

    def _check_open(self, cause: Optional[BaseException] = None) -> None:
        if self.closed():
            raise ClientClosed(f"job {self.id}: the client was closed (close() / aclose()); its waits end") from cause

    def _next_batch(self, deadline: Optional[float]) -> Step:
        """The next deltas: the durable record when (re)subscribed, quiet, told to (``SYNC``) or a
        gap shows; else the live message."""
        data = yield Receive(wait_s(deadline), time_left(deadline))
        if data is None or data == SYNC:
            return (yield from self._read_durable(quiet=data is None))
        out = feed_message(self.state, data)
        if not self.state.gap:
            return out
        self.undelivered.extend(out)  # kept if the read below fails: the state is past them
        return (yield from self._read_durable())

    def _read_durable(self, quiet: bool = False) -> Step:
        """What the durable record adds: the event stream after ``last_id``; when that adds nothing
        to a job that has not ended, its stream may have been compacted into its hash as it ended
        (complete.lua, in the same call as the final delta): read that.  ``quiet`` (a wait heard
        nothing): that read also tells whether the job has a record at all; one with none (unknown,
        expired, lost) never ends."""
        out = self.feed_record((yield READ_EVENTS))
        if out or self.state.done:
            return out
        reply = yield READ_REPLAY
        out = self.feed_replay(reply)
        if quiet and not out and not self.state.done and reply[2] is None:
            yield from self._lost()
        return out

    def _poll_result(self, deadline: Optional[float]) -> Step:
        record = yield READ_RECORD
        if not record:  # no hash at all: unknown, expired or lost (a queued or running job has one)
            yield from self._lost()
            return []
        res = result_from_hash(self.id, record)
        if res is not None:
            self.result = with_parsed(res, self.schema)
            return []
        yield WaitDone(wait_s(deadline))
        return []


    def _lost(self) -> Step:
        """The job's record is gone.  The handle that submitted it submits it again: a write lost
        with a failed master (asynchronous replication) must not lose the caller's job.  The new job
        goes on after the token ids this handle has read (no token twice, text offsets go on); any
        other handle gets ``JobNotFound`` (an unknown id, or a record expired after ``result_ttl_s``)."""
        if self.origin is None or self.resubmits >= MAX_RESUBMITS:
            raise JobNotFound(self.id)
        lane = self.state.lane(0)
        resume = list(lane.ids) if self.origin.request.n == 1 and lane.ids else None
        old = self.id
        new = yield Resubmit(resume)
        self.resubmits += 1
        self.id, self.last_id = new, "0-0"
        log.warning("job %s: its record is gone (a write lost in a failover?); submitted again as job %s, "
                    "going on after %d token(s)", old, new, len(resume or ()))


class JobHandle:
    """What ``Job`` and ``AsyncJob`` share: the handle's state, its core (``JobCore``), and which of
    its methods does each of the core's requests (``_handlers``); each subclass writes those
    methods (``_io_*``) with its own sockets, as plain calls or as coroutines."""

    def __init__(self, client, job_id: str, keys: ModelKeys, pubsub, enqueued,
                 schema: Optional[type[BaseModel]] = None, origin: Optional[Origin] = None):
        self._client = client
        self._keys = keys
        self._pubsub = pubsub  # this job's inbox on the client's shared subscriber, or None
        self.enqueued = enqueued
        # origin: the request this handle submitted, to submit again if a failover loses its record
        self._core = JobCore(job_id, keys, client.watch, schema, lambda: client.closed, origin)
        self._streaming = False  # a stream() is reading the subscription

    @property
    def id(self) -> str:
        """The job's id (a new one once the job was submitted again after its record was lost)."""
        return self._core.id

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.id!r})"

    @property
    def duplicate(self) -> bool:
        """True when an idempotency key matched an earlier submission (same job returned)."""
        return self.enqueued.status == "duplicate"

    def _submit_handlers(self, deadline: float) -> dict:
        """Each request of ``submission`` for this new handle, and what does it: subscribing and
        enqueueing are retried through a lost link until ``deadline`` (calls or coroutines, as the
        client's own ``retry``, ``_enqueue`` and the handle's ``_ensure_pubsub``/``_close_pubsub`` are)."""
        client = self._client
        return {Subscribe: lambda op: client.retry(self._ensure_pubsub, deadline),
                Enqueue: lambda op: client.retry(lambda: client._enqueue(op), deadline),
                Unsubscribe: lambda op: self._close_pubsub()}

    def _handlers(self) -> dict:
        """Each request of the core and the method that does it."""
        return {Receive: self._io_receive, ReadEvents: self._io_read_events, ReadReplay: self._io_read_replay,
                ReadRecord: self._io_read_record, WaitDone: self._io_wait_done, Pause: self._io_pause,
                Resubmit: self._io_resubmit}


def feed_message(state: StreamState, data: bytes) -> list[Delta]:
    """The deltas a live pub/sub message adds to ``state`` (none for a malformed one)."""
    return state.feed_all(payload_deltas(data))


def decode_status(raw: Optional[bytes]) -> Optional[str]:
    return raw.decode() if raw else None


def submit_kwargs(prompt, messages, prompt_tokens, session_id, source: str, params: dict) -> dict:
    """``submit``'s arguments as the request's fields (``submitted_at`` now)."""
    return dict(prompt=prompt, messages=messages, prompt_tokens=prompt_tokens, session_id=session_id,
                source=source, submitted_at=time.time(), **params)


# -- the subscribers' shared part --------------------------------------------------------------------

def channel_bytes(channel: str | bytes) -> bytes:
    return channel.encode() if isinstance(channel, str) else channel


class Inboxes:
    """What ``Subscriber`` and ``AsyncSubscriber`` share (they differ only in threads vs tasks): the
    inboxes of each job's channel (one per handle on the job: each gets every message), the node
    readers, what a pub/sub message means (``route``), and the ``SYNC`` each job of a lost link gets
    once its channel is subscribed again (``resync``)."""

    def __init__(self, client, confirm_timeout: float):
        self.client = client
        self.sharded = is_cluster(client)
        self.confirm_timeout = confirm_timeout
        self._readers: dict = {}  # node name -> its reader
        # channel -> its handles' inboxes (queue.Queue or asyncio.Queue), a tuple replaced on each
        # change: a reader thread delivers without the lock
        self._inboxes: dict[bytes, tuple] = {}
        self._closed = False

    def confirm_s(self, limit: Optional[float]) -> float:
        """How long a subscription's confirmation is waited for: ``confirm_timeout``, or less."""
        return self.confirm_timeout if limit is None else min(self.confirm_timeout, limit)

    def cut_short(self, exc: BaseException, limit: Optional[float]) -> Optional[ConfirmCut]:
        """A ``ConfirmCut`` for ``exc`` when it is a confirmation's timeout that ``limit`` (the caller's
        deadline) made shorter than ``confirm_timeout``; else None."""
        if isinstance(exc, redis.TimeoutError) and limit is not None and limit < self.confirm_timeout:
            return ConfirmCut(str(exc))
        return None

    def connections(self) -> int:
        """Pub/sub connections held now (one per node with subscribed channels)."""
        return len(self._readers)

    def route(self, reader, msg: dict) -> None:
        """One message read on ``reader``'s link: a confirmed subscription, or a job's delta."""
        kind, channel = msg["type"], msg["channel"]
        if kind in ("subscribe", "ssubscribe"):
            reader.confirmed(channel)
        elif kind in ("message", "smessage"):
            self.deliver(channel, msg["data"])

    def deliver(self, channel: bytes, data: bytes) -> None:
        for inbox in self._inboxes.get(channel, ()):
            inbox.put_nowait(data)

    def add_inbox(self, channel: bytes, inbox) -> None:
        self._inboxes[channel] = (*self._inboxes.get(channel, ()), inbox)

    def drop_inbox(self, channel: bytes, inbox=None) -> bool:
        """Stop routing ``channel`` to ``inbox`` (None: to none); True when no handle is left on the
        channel, so its subscription may go."""
        left = tuple(i for i in self._inboxes.get(channel, ()) if i is not inbox)
        if left:
            self._inboxes[channel] = left
            return False
        self._inboxes.pop(channel, None)
        return True

    def forget(self, reader, exc: Optional[BaseException]) -> None:
        """A reader's link dropped: it serves no new subscription (its channels move to a fresh one)."""
        log.warning("pub/sub link to %s lost (%s); resubscribing %d channels", reader.node, exc,
                    len(reader.channels))
        if self._readers.get(reader.node) is reader:
            del self._readers[reader.node]

    def resync(self, channels) -> None:
        """Tell each job of ``channels`` to read its durable record (messages sent meanwhile are there)."""
        for ch in channels:
            self.deliver(ch, SYNC)
