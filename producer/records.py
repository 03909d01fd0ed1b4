"""A job's output as its readers see it: the deltas of a live message or a stream entry, the reading state
that keeps one copy of each (``StreamState``), and the job record's result (``result_from_hash``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ..shared import codec
from ..shared.schemas import Delta, JobStats, Result

TERMINAL = {"done", "failed", "cancelled", "dead", "expired"}


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
