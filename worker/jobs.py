"""A job's life inside the worker: from a pulled queue entry to its final result."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from pydantic import ValidationError

from mlxq.shared import codec
from mlxq.shared.protocol import Pulled, owner_token
from mlxq.shared.schemas import Delta, GenerateRequest, JobStats, Result
from .engine_api import SeqSpec
from .sampling import make_processors, make_sampler, resolve_seed
from .textstream import TextStream

log = logging.getLogger(__name__)

# mlx-lm server's fallback for a model without a chat template (``convert_chat``): role-prefixed lines.
PLAIN_CHAT_ROLES = {"system": "ASSISTANT's RULE: ", "user": "USER: ", "assistant": "ASSISTANT: "}
PLAIN_CHAT_STOP = "\n"
_warned_no_template: set[int] = set()


class JobError(ValueError):
    """This job cannot run; it finishes with ``error`` and this message."""


@dataclass
class ActiveJob:
    id: str
    request: GenerateRequest
    attempt: int
    owner: str
    tier: str
    score: float
    queued_at: float
    started_at: float
    prompt: list[int]
    seed: int
    text: TextStream
    clock_offset: float  # Redis server time minus local time, to report server-clock stamps
    tokens: list[int] = field(default_factory=list)  # generated ids (no EOS)
    full_text: str = ""  # all text produced so far (across a resume)
    sent_chars: int = 0  # how much of full_text has been published
    seq: int = 0  # the last published delta's sequence number
    first_token_at: Optional[float] = None
    logprobs: list = field(default_factory=list)
    cached_tokens: int = 0
    resumed: bool = False

    def now(self) -> float:
        return time.time() + self.clock_offset

    def spec(self, eos_token_ids) -> SeqSpec:
        params = self.request.params()
        done = len(self.tokens)
        return SeqSpec(
            uid=self.id,
            prompt=self.prompt,
            max_tokens=params.max_tokens - done,
            sampler=make_sampler(params, self.seed, start_step=done),
            logits_processors=make_processors(params),
            stop_token_ids=() if params.ignore_eos else tuple(eos_token_ids),
            resume_tokens=list(self.tokens),
            priority=self.score,
            session_id=self.request.session_id,
        )

    def take_text(self, new_text: str) -> str:
        """Append produced text; return the part not yet published (never twice)."""
        self.full_text += new_text
        out = self.full_text[self.sent_chars :]
        self.sent_chars = max(self.sent_chars, len(self.full_text))
        return out

    def next_delta(self, text: str, ids: list[int], finish: Optional[str] = None,
                   error: Optional[str] = None, logprobs: Optional[list] = None) -> Delta:
        self.seq += 1
        return Delta(attempt=self.attempt, seq=self.seq, text=text, token_ids=ids,
                     finish_reason=finish, error=error, logprobs=logprobs)

    def resume_state(self) -> bytes:
        """What a later attempt needs to continue without re-sending anything."""
        return codec.pack({
            "tokens": self.tokens, "seq": self.seq, "text": self.full_text,
            "sent": self.sent_chars, "first_token_at": self.first_token_at, "seed": self.seed,
            "attempt": self.attempt, "started_at": self.started_at,
        })

    def result(self, finish: str, error: Optional[str] = None) -> Result:
        finished = self.now()
        gen = len(self.tokens)
        stats = JobStats(
            queued_at=self.queued_at,
            started_at=self.started_at,
            first_token_at=self.first_token_at,
            finished_at=finished,
            prompt_tokens=len(self.prompt),
            cached_tokens=self.cached_tokens,
            generated_tokens=gen,
            queue_wait_s=max(0.0, self.started_at - self.queued_at),
            ttft_s=(self.first_token_at - self.queued_at) if self.first_token_at else None,
            prompt_tps=(len(self.prompt) / max(1e-9, self.first_token_at - self.started_at))
            if self.first_token_at else None,
            generation_tps=((gen - 1) / max(1e-9, finished - self.first_token_at))
            if self.first_token_at and gen > 1 else None,
            attempts=self.attempt,
            tier=self.tier,
            worker=self.owner.rsplit(":", 1)[0],  # the owner token is worker_id:attempt
            seed=self.seed,
        )
        return Result(id=self.id, text=self.full_text, token_ids=list(self.tokens), finish_reason=finish,
                      error=error, logprobs=self.logprobs or None, stats=stats)


def decode_request(pulled: Pulled, model_name: str, settings_max_new: int) -> GenerateRequest:
    """Validate the stored request again: producers can be buggy or hostile."""
    try:
        raw = codec.unpack(pulled.raw_request)
    except codec.CodecError as exc:
        raise JobError(f"malformed request: {exc}") from None
    if not isinstance(raw, dict):
        raise JobError(f"malformed request: expected a map, got {type(raw).__name__}")
    try:
        req = GenerateRequest.model_validate(raw)
    except ValidationError as exc:
        raise JobError(f"invalid request: {_short(exc)}") from None
    if req.id != pulled.job_id:
        raise JobError("invalid request: its id does not match the queue entry")
    if req.model != model_name:
        raise JobError(f"unknown model {req.model!r}: this queue is served by {model_name!r}")
    if req.max_tokens > settings_max_new:
        raise JobError(f"max_tokens {req.max_tokens} exceeds this worker's limit {settings_max_new}")
    return req


def _short(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors()[:5]:
        loc = ".".join(str(x) for x in err.get("loc", ())) or "request"
        parts.append(f"{loc}: {err.get('msg')}")
    return "; ".join(parts)


def tokenize(req: GenerateRequest, tokenizer) -> list[int]:
    if req.prompt_tokens is not None:
        vocab = len(getattr(tokenizer, "_tokenizer", tokenizer))
        if any(t >= vocab for t in req.prompt_tokens):
            raise JobError(f"prompt_tokens contains ids outside the vocabulary (size {vocab})")
        return list(req.prompt_tokens)
    if req.messages is not None:
        msgs = [m.model_dump() for m in req.messages]
        if not getattr(tokenizer, "chat_template", None):
            if id(tokenizer) not in _warned_no_template:
                _warned_no_template.add(id(tokenizer))
                log.warning("this model has no chat template: chat messages are sent as role-prefixed plain "
                            "text (USER: ... ASSISTANT:), as mlx-lm's server does")
            return _encode(tokenizer, plain_chat_prompt(msgs))
        try:
            ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        except Exception as exc:  # templates are user code
            raise JobError(f"chat template failed: {exc}") from None
        return list(ids["input_ids"] if isinstance(ids, dict) else ids)
    return _encode(tokenizer, req.prompt)


def _encode(tokenizer, text: str) -> list[int]:
    ids = tokenizer.encode(text)
    if not ids:
        raise JobError("the prompt tokenizes to nothing")
    return list(ids)


def plain_chat_prompt(messages: list[dict]) -> str:
    """Chat messages as plain text for a model without a chat template (mlx-lm's ``convert_chat``)."""
    text = "".join(f"{PLAIN_CHAT_ROLES.get(m['role'], '')}{m['content']}{PLAIN_CHAT_STOP}" for m in messages)
    return (text + PLAIN_CHAT_ROLES["assistant"]).rstrip()


def start_job(pulled: Pulled, req: GenerateRequest, prompt: list[int], tokenizer, worker_id: str,
              clock_offset: float) -> ActiveJob:
    resume: dict[str, Any] = {}
    if pulled.resume:
        try:
            resume = codec.unpack(pulled.resume)
        except codec.CodecError:
            resume = {}
        if not isinstance(resume, dict) or resume.get("attempt") != pulled.attempt:
            resume = {}
    seed = resume.get("seed") if isinstance(resume.get("seed"), int) else resolve_seed(req.params())
    job = ActiveJob(
        id=pulled.job_id, request=req, attempt=pulled.attempt,
        owner=owner_token(worker_id, pulled.attempt), tier=pulled.tier, score=pulled.score,
        queued_at=pulled.queued_at, started_at=pulled.now, prompt=prompt, seed=seed,
        text=TextStream.for_tokenizer(tokenizer, req.stop), clock_offset=clock_offset,
    )
    tokens = resume.get("tokens")
    if tokens and isinstance(tokens, list) and all(isinstance(t, int) for t in tokens):
        # Rebuild the text state silently; only text beyond what was sent goes out.
        job.resumed = True
        job.tokens = list(tokens)
        for t in tokens:
            job.full_text += job.text.add(t)
        job.sent_chars = int(resume.get("sent", 0))
        job.seq = int(resume.get("seq", 0))
        job.first_token_at = resume.get("first_token_at")
        if isinstance(resume.get("started_at"), (int, float)):  # queue_wait_s: until the job first started
            job.started_at = resume["started_at"]
    return job
