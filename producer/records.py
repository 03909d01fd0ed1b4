"""What the sync and async clients share: request building, checks, stream bookkeeping."""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import redis

from ..shared import codec
from ..shared.schemas import Delta, GenerateRequest, JobStats, Result

TERMINAL = {"done", "failed", "cancelled", "dead"}

log = logging.getLogger("mlxq.producer")


class NoModelError(LookupError):
    """No model given and none could be chosen, or the one given is served by no worker."""


class JobTimeout(TimeoutError):
    pass


class ConfirmCut(redis.TimeoutError):
    """A subscription's confirmation not waited for to its end: the caller's deadline came first. Not a
    lost link (the job's wait ends with ``JobTimeout``, not ``RedisUnreachable``)."""


class ClientClosed(RuntimeError):
    """The client was closed (``close()`` / ``aclose()``) before or while one of its jobs' waits ran:
    ``result()`` and ``stream()`` raise it, in every thread or task waiting on them."""


class JobNotFound(LookupError):
    """The job has no record in Redis: an id no producer submitted (on this model), or a job whose
    record expired (``result_ttl_s`` after it ended). Its stream and result can never come."""

    def __init__(self, job_id: str):
        super().__init__(f"job {job_id} is unknown, or its record expired (results are kept for result_ttl_s)")
        self.job_id = job_id


def build_request(model: str, kwargs: dict[str, Any]) -> GenerateRequest:
    """Validate a submission before anything reaches Redis (pydantic raises ValueError)."""
    if kwargs.get("id") is not None:  # ids are 128 random bits, never the caller's choice (guessable)
        raise ValueError("id= is not accepted: mlxq chooses job ids (128 random bits)")
    return GenerateRequest.model_validate({"model": model, **{k: v for k, v in kwargs.items() if v is not None}})


def check_fits(req: GenerateRequest, info: Optional[dict], count_tokens=None) -> None:
    """Refuse at submit what the model's worker would refuse anyway (a ValueError, HTTP 400).

    The prompt's length: for ``prompt_tokens`` the count is exact; for text, ``count_tokens(text)``
    when the caller can tokenize (the gateway on the models' host), else ``bytes / longest token``,
    a lower bound, so nothing that could fit is refused.  Also ids outside the vocabulary and
    ``max_tokens`` above the workers' limit.
    """
    if not info:
        return
    limit = int(info.get("max_new_tokens") or 0)
    if limit and req.max_tokens > limit:
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
    if n >= ctx:
        raise ContextLengthError(f"prompt {what} {n} tokens can never fit the model's context of {ctx} tokens")
    if "max_tokens" in req.model_fields_set and n + req.max_tokens > ctx:  # n is exact or a lower bound
        has = f"at least {n}" if what != "of" else str(n)
        raise ContextLengthError(f"this model's context is {ctx} tokens; the prompt has {has} and max_tokens asks "
                                 f"for {req.max_tokens} more: lower max_tokens, or shorten the prompt")


class ContextLengthError(ValueError):
    """A prompt longer than the model's context (OpenAI's ``context_length_exceeded``)."""


def pick_model(explicit: Optional[str], registered: dict[str, dict]) -> str:
    if explicit:
        return explicit
    env = os.environ.get("MLXQ_MODEL")
    if env:
        return env
    if len(registered) == 1:
        return next(iter(registered))
    if not registered:
        raise NoModelError("no model given and no worker has registered one (pass model=, or set MLXQ_MODEL)")
    raise NoModelError(f"several models are served ({sorted(registered)}): pass model=")


def decode_registry(raw: dict) -> dict[str, dict]:
    """name -> info; a model whose info cannot be read is still registered (with ``{}``)."""
    out = {}
    for name, blob in raw.items():
        name = name.decode() if isinstance(name, bytes) else name
        try:
            info = codec.unpack(blob)
        except codec.CodecError:
            info = None
        out[name] = info if isinstance(info, dict) else {}
    return out


def known_model(model: str, registry: Optional[dict[str, dict]]) -> Optional[dict]:
    """The registry's info on ``model``; ``NoModelError`` naming the models that exist when workers
    have registered models but never this one.  None, and no check, when the registry could not be
    read (``registry`` None) or is empty (a fresh deployment whose workers are still starting: the job
    waits in the queue, and ``status()`` says "queued, no live worker for MODEL")."""
    if not registry:
        return None
    if model not in registry:
        raise NoModelError(f"model {model!r} is not served by any worker (models: {', '.join(sorted(registry))}); "
                           "pass one of these, or start `mlxq worker --model ...` for it")
    return registry[model]


_unreadable_once = threading.Lock()  # taken by the first report, never released: one log line


def registry_unreadable(exc: Exception) -> None:
    """A producer whose Redis user may not read the model registry submits unchecked (logged once)."""
    if _unreadable_once.acquire(blocking=False):
        log.info("cannot read the model registry (%s): jobs are submitted without checking that the model "
                 "exists or has a live worker", exc)


def has_live_worker(info: Optional[dict], window_s: float, now: Optional[float] = None) -> bool:
    """True when a worker of this model published its stats (the registry's ``seen_at``, written
    every ``stats_interval_s``) within ``window_s`` seconds (``Settings.live_worker_s``)."""
    seen = (info or {}).get("seen_at")
    if not isinstance(seen, (int, float)):
        return False
    return (time.time() if now is None else now) - seen <= window_s


def status_text(status: Optional[str], model: str, info: Optional[dict], window_s: float) -> Optional[str]:
    """A job's status, with "queued, no live worker for MODEL" when nothing can take it now.
    ``info`` None (the registry could not be read): the bare status."""
    if status == "queued" and info is not None and not has_live_worker(info, window_s):
        return f"queued, no live worker for {model}"
    return status


def payload_deltas(payload: bytes) -> list[Delta]:
    """The deltas of a worker's msgpack payload (one, or a job's samples' of one step); none for a
    malformed one (it is skipped)."""
    try:
        return Delta.all_from_wire(codec.unpack(payload))
    except (codec.CodecError, ValueError, TypeError, AttributeError):
        return []


def entry_deltas(fields: dict) -> list[Delta]:
    """A stream entry: a worker's msgpack payload (``d``) or a terminal event written by Lua."""
    f = {(k.decode() if isinstance(k, bytes) else k): v for k, v in fields.items()}
    if "d" in f:
        return payload_deltas(f["d"])
    reason = f.get("f", b"error")
    reason = reason.decode() if isinstance(reason, bytes) else reason
    err = f.get("e")
    return [Delta(attempt=-1, seq=-1, finish_reason=reason, error=err.decode() if isinstance(err, bytes) else err)]


@dataclass
class Lane:
    """One sample's reading position: token ids and characters yielded, and whether it ended."""

    ids: list[int] = field(default_factory=list)  # the token ids yielded (a resubmit's resume point)
    chars: int = 0
    done: bool = False
    # a job submitted with resume_ids starts after them, its text after theirs: the first delta at the
    # next index says where that text ends (this side has no tokenizer to count it)
    chars_unknown: bool = False

    @property
    def tokens(self) -> int:
        return len(self.ids)


@dataclass
class StreamState:
    """Keeps exactly one copy of each token index and each character of a job's output.

    Every delta says where it starts: ``index`` (its first token id's position in its sample's
    tokens) and ``offset`` (its text's position in its sample's text).  Those are absolute across
    attempts: a worker that takes over a crashed or preempted job continues from the durable
    record.  So the same delta read twice (live, then again from the record) or a delta that
    overlaps what was yielded adds only what is new; a delta that starts past what was yielded
    leaves a gap (``gap``), and the caller re-reads the durable record, which has it.

    A job with n > 1 has one lane per sample (``Delta.sample``); a delta with a finish reason ends
    its sample, and says how many samples the job has (``Delta.n_samples``): the job is ``done`` when
    every one has ended, or at a job-wide end (a terminal event, a final delta with no sample).
    """

    lanes: dict[int, Lane] = field(default_factory=dict)
    samples: int = 1  # the job's samples, as its final deltas tell
    done: bool = False
    gap: bool = False  # the last delta fed starts past what was yielded: re-read the record

    @property
    def tokens(self) -> int:
        """Token ids of sample 0 yielded so far: the next index expected."""
        return self.lane(0).tokens

    @property
    def chars(self) -> int:
        return self.lane(0).chars

    def lane(self, sample: Optional[int]) -> Lane:
        return self.lanes.setdefault(sample or 0, Lane())

    def feed_all(self, deltas: list[Delta]) -> list[Delta]:
        """``feed`` each of one payload's deltas; ``gap`` when any of them left one."""
        out: list[Delta] = []
        gap = False
        for d in deltas:
            out += self.feed(d)
            gap = gap or self.gap
        self.gap = gap
        return out

    def feed(self, d: Optional[Delta]) -> list[Delta]:
        self.gap = False
        if self.done or d is None:
            return []
        if d.attempt == -1:  # terminal event from a script (cancel, dead-letter)
            self.done = True
            return [d]
        lane = self.lane(d.sample)
        if lane.done:
            return []
        if lane.chars_unknown and d.index == lane.tokens:
            lane.chars, lane.chars_unknown = d.offset, False
        if d.index > lane.tokens or d.offset > lane.chars:
            self.gap = True
            return []
        skip_ids, skip_chars = lane.tokens - d.index, lane.chars - d.offset
        ids, text = d.token_ids[skip_ids:], d.text[skip_chars:]
        if not (ids or text or d.finish_reason):
            return []  # all of it was yielded already
        lane.ids += ids
        lane.chars += len(text)
        if d.finish_reason is not None:
            self._ended(lane, d)
        if not (skip_ids or skip_chars):
            return [d]
        lp = d.logprobs[skip_ids:] if d.logprobs is not None else None
        return [d.model_copy(update={"token_ids": ids, "text": text, "logprobs": lp,
                                     "index": lane.tokens - len(ids), "offset": lane.chars - len(text)})]

    def _ended(self, lane: Lane, d: Delta) -> None:
        lane.done = True
        self.samples = max(self.samples, d.n_samples or 1)
        ended = sum(1 for x in self.lanes.values() if x.done)
        self.done = d.sample is None or ended >= self.samples


# the job record's fields completion drops, which the result's stats keep (PROTOCOL.md's job record)
IN_RESULT_STATS = ("tier", "attempts", "queued_at", "started_at", "worker")


def record_fields(h: dict) -> dict:
    """A job record (HGETALL) by field name; a finished one's ``IN_RESULT_STATS`` from its result's
    stats, as the record had them while the job ran."""
    h = {(k.decode() if isinstance(k, bytes) else k): v for k, v in h.items()}
    if h.get("result"):
        try:
            stats = codec.unpack(h["result"]).get("stats") or {}
        except Exception:  # noqa: BLE001 - a result a worker wrote badly: the other fields still read
            stats = {}
        for name in IN_RESULT_STATS:
            if name not in h and stats.get(name) is not None:
                h[name] = str(stats[name]).encode()
    return h


def result_from_hash(job_id: str, h: dict) -> Optional[Result]:
    h = {(k.decode() if isinstance(k, bytes) else k): v for k, v in h.items()}
    status = h.get("status")
    status = status.decode() if isinstance(status, bytes) else status
    if status not in TERMINAL:
        return None
    if h.get("result"):  # the record's result has no id: its key holds it (Result.record)
        return Result.model_validate({**codec.unpack(h["result"]), "id": job_id})
    reason = "cancelled" if status == "cancelled" else "error"
    # A queued job's ``error`` is the failure it was given back with (a suspect, PROTOCOL.md's
    # job hash); a cancel ends it before any worker runs it again, and that was no error of its.
    err = h.get("error") if reason == "error" else None
    err = err.decode() if isinstance(err, bytes) else err
    stats = JobStats(queued_at=_f(h.get("queued_at")), finished_at=_f(h.get("finished_at")),
                     attempts=int(_f(h.get("attempts")) or 0))
    return Result(id=job_id, finish_reason=reason, error=err, stats=stats)


def _f(x) -> Optional[float]:
    if x is None:
        return None
    try:
        return float(x.decode() if isinstance(x, bytes) else x)
    except ValueError:
        return None
