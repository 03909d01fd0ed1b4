"""Pydantic schemas of what crosses Redis: requests, deltas, results, stats."""

from __future__ import annotations

import secrets
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, field_validator, model_validator

FinishReason = Literal["stop", "length", "cancelled", "error"]
MAX_STOP_STRINGS = 16
MAX_STOP_LEN = 256
MAX_MESSAGES = 1024


def new_job_id() -> str:
    """128 random bits as hex: channels and keys cannot be guessed."""
    return secrets.token_hex(16)


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant", "tool"]
    content: StrictStr = Field(max_length=4 * 1024 * 1024)


class SamplingParams(BaseModel):
    """Per-request sampling knobs, honoured inside a batch."""

    model_config = ConfigDict(extra="forbid")
    max_tokens: StrictInt = Field(256, ge=1, le=1_000_000)
    temperature: float = Field(0.0, ge=0.0, le=10.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: StrictInt = Field(0, ge=0, le=1_000_000)
    min_p: float = Field(0.0, ge=0.0, lt=1.0)
    repetition_penalty: Optional[float] = Field(None, gt=0.0, le=10.0)
    seed: Optional[StrictInt] = Field(None, ge=0, lt=2**63)
    stop: list[StrictStr] = Field(default_factory=list, max_length=MAX_STOP_STRINGS)
    logprobs: StrictInt = Field(0, ge=0, le=20)  # 0: none; k: the token's logprob and the top k
    ignore_eos: bool = False  # generate exactly max_tokens (benchmarks, load tests), as vLLM's flag

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: list[str]) -> list[str]:
        for s in v:
            if not s or len(s) > MAX_STOP_LEN:
                raise ValueError(f"each stop string must be 1..{MAX_STOP_LEN} characters")
        return v

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class GenerateRequest(SamplingParams):
    """One generation job as stored in Redis (``job.req``)."""

    id: StrictStr = Field(default_factory=new_job_id, pattern=r"^[0-9a-f]{32}$")
    model: StrictStr = Field(min_length=1, max_length=256)
    prompt: Optional[StrictStr] = Field(None, max_length=4 * 1024 * 1024)
    messages: Optional[list[Message]] = Field(None, min_length=1, max_length=MAX_MESSAGES)
    prompt_tokens: Optional[list[StrictInt]] = Field(None, min_length=1, max_length=1_000_000)
    session_id: Optional[StrictStr] = Field(None, min_length=1, max_length=128)
    source: StrictStr = Field("client", max_length=32)
    submitted_at: float = 0.0

    @model_validator(mode="after")
    def _one_input(self) -> "GenerateRequest":
        given = [x is not None for x in (self.prompt, self.messages, self.prompt_tokens)]
        if sum(given) != 1:
            raise ValueError("give exactly one of prompt=, messages= or prompt_tokens=")
        if self.prompt is not None and not self.prompt:
            raise ValueError("prompt must not be empty")
        if self.prompt_tokens is not None and any(t < 0 for t in self.prompt_tokens):
            raise ValueError("prompt_tokens must be non-negative token ids")
        return self

    def params(self) -> SamplingParams:
        return SamplingParams.model_validate(self.model_dump(include=set(SamplingParams.model_fields)))


class Delta(BaseModel):
    """A piece of a job's output, as streamed.

    ``index`` is the absolute position of its first token id in the job's generated tokens, and
    ``offset`` the absolute position of its text in the job's text, whatever the attempt: a worker
    that takes over a crashed or preempted job continues from what the durable record holds, so a
    subscriber keeps exactly one copy of each index (and of each character).  ``seq`` counts a job's
    deltas from 1 across all its attempts; ``attempt`` says which run produced it.
    """

    model_config = ConfigDict(extra="ignore")
    attempt: int = 1
    seq: int = 0
    index: int = 0
    offset: int = 0
    text: str = ""
    token_ids: list[int] = Field(default_factory=list)
    finish_reason: Optional[FinishReason] = None
    error: Optional[str] = None
    logprobs: Optional[list] = None

    def to_wire(self) -> dict:
        d = {"a": self.attempt, "s": self.seq, "n": self.index, "c": self.offset, "t": self.text,
             "i": self.token_ids}
        if self.finish_reason:
            d["f"] = self.finish_reason
        if self.error:
            d["e"] = self.error
        if self.logprobs is not None:
            d["lp"] = self.logprobs
        return d

    @classmethod
    def from_wire(cls, d: dict) -> "Delta":
        return cls(
            attempt=int(d.get("a", 1)),
            seq=int(d.get("s", 0)),
            index=int(d.get("n", 0)),
            offset=int(d.get("c", 0)),
            text=d.get("t", "") or "",
            token_ids=list(d.get("i", []) or []),
            finish_reason=d.get("f") or None,
            error=d.get("e") or None,
            logprobs=d.get("lp"),
        )


class JobStats(BaseModel):
    model_config = ConfigDict(extra="allow")
    queued_at: Optional[float] = None
    started_at: Optional[float] = None
    first_token_at: Optional[float] = None
    finished_at: Optional[float] = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    queue_wait_s: Optional[float] = None
    ttft_s: Optional[float] = None
    prompt_tps: Optional[float] = None
    generation_tps: Optional[float] = None
    attempts: int = 1
    tier: Optional[str] = None
    worker: Optional[str] = None


class Usage(BaseModel):
    """Token counts of one job, as OpenAI reports them (``cached_tokens``: prompt tokens whose KV came
    from the prefix cache)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    cached_tokens: int = 0


# Result.error_code values: why a job failed
INVALID_REQUEST = "invalid_request"  # the request can never run (too long, bad ids...): HTTP 400
INTERNAL_ERROR = "internal_error"  # the worker failed: HTTP 500


class Result(BaseModel):
    model_config = ConfigDict(extra="ignore")
    id: str
    text: str = ""
    token_ids: list[int] = Field(default_factory=list)
    finish_reason: FinishReason
    error: Optional[str] = None
    error_code: Optional[str] = None  # INVALID_REQUEST | INTERNAL_ERROR when finish_reason is "error"
    logprobs: Optional[list] = None
    stats: JobStats = Field(default_factory=JobStats)

    @property
    def usage(self) -> Usage:
        p, c = self.stats.prompt_tokens, self.stats.generated_tokens
        return Usage(prompt_tokens=p, completion_tokens=c, total_tokens=p + c, cached_tokens=self.stats.cached_tokens)
