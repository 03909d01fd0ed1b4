"""A job's life inside the worker: from a pulled queue entry to its final result."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from pydantic import ValidationError

from ..shared import codec
from ..shared.protocol import Pulled, owner_token
from ..shared.constraints import ConstraintError, ModelFormat
from ..shared.grammars import grammar_for
from ..shared.schemas import Delta, GenerateRequest, JobStats, Result, SampleOutput, ToolCall, wire_deltas
from ..shared.tools import check_tools, uses_tools
from .engine.api import EmbedSpec, SeqSpec
from .engine.sampler import make_sampler, repetition_penalty, resolve_seed
from .textstream import ChatStream, TextStream, chat_format, decode_fn, vocab_size
from .toolprompt import call_parser, own_tool_messages, serving_format, traits

log = logging.getLogger(__name__)

# mlx-lm server's fallback for a model without a chat template (``convert_chat``): role-prefixed lines.
PLAIN_CHAT_ROLES = {"system": "ASSISTANT's RULE: ", "user": "USER: ", "assistant": "ASSISTANT: "}
PLAIN_CHAT_STOP = "\n"
_warned_no_template: set[int] = set()


class JobError(ValueError):
    """This job cannot run; it finishes with ``error`` and this message."""


@dataclass
class SampleGroup:
    """The samples of a job with n > 1 (each an ``ActiveJob`` with its ``sample`` index): the outputs
    of those that ended, until the last one ends the job."""

    n: int
    outputs: dict[int, SampleOutput] = field(default_factory=dict)
    first_token_at: Optional[float] = None
    cached_tokens: int = 0
    drafts: tuple[int, int] = (0, 0)  # the samples' speculative decoding counts, summed

    def end(self, job: "ActiveJob", out: SampleOutput) -> bool:
        """Sample ``out.index`` ended; True when it was the job's last."""
        self.outputs[out.index] = out
        self.drafts = (self.drafts[0] + job.drafts[0], self.drafts[1] + job.drafts[1])
        firsts = [t for t in (self.first_token_at, job.first_token_at) if t is not None]
        self.first_token_at = min(firsts) if firsts else None
        self.cached_tokens = max(self.cached_tokens, job.cached_tokens)
        return len(self.outputs) == self.n


def sample_uid(job_id: str, sample: Optional[int]) -> str:
    """The engine sequence of a job's sample: the job id for an n == 1 job, else ``job#i``."""
    return job_id if sample is None else f"{job_id}#{sample}"


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
    text: ChatStream  # the answer, and a chat job's reasoning and tool calls
    clock_offset: float  # Redis server time minus local time, to report server-clock stamps
    tokens: list[int] = field(default_factory=list)  # generated ids (no EOS)
    full_text: str = ""  # all text produced so far (across a resume)
    sent_chars: int = 0  # how much of full_text has been published
    sent_reasoning: int = 0  # how much of text.reasoning has been published
    sent_calls: int = 0  # how many of text.calls have been published
    sent_args: int = 0  # how much of the arguments of the call being written (number sent_calls) went out
    seq: int = 0  # the last published delta's sequence number
    first_token_at: Optional[float] = None
    logprobs: list = field(default_factory=list)
    cached_tokens: int = 0
    drafts: tuple[int, int] = (0, 0)  # speculative decoding: tokens proposed and accepted (TokenEvent's, summed)
    grammar: Optional[str] = None  # the llguidance grammar its output follows (None: free text)
    sample: Optional[int] = None  # the sample index of a job with n > 1 (None: n == 1)
    group: Optional[SampleGroup] = None  # n > 1: the job's samples
    # the error it was given back with after an engine raised while holding it (Pulled.suspect; ""
    # for none): the worker runs this job alone (admit_now)
    suspect: str = ""
    # the request's timeout_s as a time.monotonic() deadline (None: no limit), and whether the worker
    # has ended the job for it already (the MLX thread asks once)
    deadline: Optional[float] = None
    timed_out: bool = False
    # an embedding job (request.embed): the pooling it runs with (the request's, else the worker's
    # rule), and its vector once the engine ended it (codec.pack_vector)
    pooling: Optional[str] = None
    embedding: Optional[str] = None

    @property
    def uid(self) -> str:
        """The engine sequence of this sample (the job id for an n == 1 job)."""
        return sample_uid(self.id, self.sample)

    def now(self) -> float:
        return time.time() + self.clock_offset

    def spec(self, eos_token_ids) -> SeqSpec:
        embed = self.request.embed
        if embed is not None:
            return SeqSpec(uid=self.uid, prompt=self.prompt, max_tokens=1, priority=self.score,
                           embed=EmbedSpec(self.pooling or "last", embed.normalize, embed.dimensions))
        params = self.request.params()
        done = len(self.tokens)
        sample = self.sample or 0
        return SeqSpec(
            uid=self.uid,
            prompt=self.prompt,
            # samples 1..n-1 may share sample 0's prompt KV (an engine without forks prefills each)
            fork_of=sample_uid(self.id, 0) if sample else None,
            fork_len=len(self.prompt) if sample else 0,
            max_tokens=params.max_tokens - done,
            sampler=make_sampler(params, self.seed, start_step=done, sample=sample),
            repetition_penalty=repetition_penalty(params),
            stop_token_ids=() if params.ignore_eos else tuple(eos_token_ids),
            resume_tokens=list(self.tokens),
            priority=self.score,
            session_id=self.request.session_id,
            grammar=self.grammar,
            presence_penalty=params.presence_penalty,
            frequency_penalty=params.frequency_penalty,
            logit_bias=params.logit_bias,
        )

    def emit(self, new_text: str, ids: list[int], finish: Optional[str] = None, error: Optional[str] = None,
             logprobs: Optional[list] = None) -> Delta:
        """The next delta: ``ids`` (already appended to ``tokens``) and the text not yet published,
        each with its absolute position, so nothing is ever published twice."""
        self.full_text += new_text
        offset = self.sent_chars
        text = self.full_text[offset:]
        self.sent_chars = max(offset, len(self.full_text))
        r_offset, k = self.sent_reasoning, self.sent_calls
        reasoning, calls = self.text.reasoning[r_offset:], self.tool_calls()[k:]
        if calls:  # the call that streamed ended: the next one starts from its first character
            self.sent_args = 0
        self.sent_reasoning, self.sent_calls = r_offset + len(reasoning), k + len(calls)
        partial, a_offset = self.text.partial_call(), self.sent_args
        args = partial[1][a_offset:] if partial else ""
        self.sent_args = a_offset + len(args)
        opened = bool(args)  # a head comes with its arguments' first character
        self.seq += 1
        return Delta(attempt=self.attempt, seq=self.seq, index=len(self.tokens) - len(ids), offset=offset,
                     text=text, token_ids=list(ids), finish_reason=self.final_reason(finish), error=error,
                     logprobs=logprobs, reasoning=reasoning, reasoning_offset=r_offset,
                     tool_calls=calls or None, tool_call_index=k, sample=self.sample,
                     partial_call_id=call_id(self.id, self.sent_calls, self.sample) if opened else None,
                     partial_call_name=partial[0] if opened else None, partial_args=args,
                     partial_args_offset=a_offset,
                     n_samples=self.group.n if finish and self.group else None)

    def tool_calls(self) -> list[ToolCall]:
        """The calls parsed so far, OpenAI's shape; an id is a hash of the job id and the call's
        number, so an attempt that takes the job over names each call as the first one did."""
        return [ToolCall(id=call_id(self.id, k, self.sample), function=call) for k, call in enumerate(self.text.calls)]

    def final_reason(self, finish: Optional[str]) -> Optional[str]:
        """OpenAI's "tool_calls" for a job that stopped (EOS, a stop string) after making calls."""
        return "tool_calls" if finish == "stop" and self.text.calls else finish

    def wire_dict(self, delta: Delta) -> dict:
        """A delta as published; a job's first delta also records its seed, so a run that takes the
        job over samples from the same stream (an unseeded sampled job too)."""
        d = delta.to_wire()
        if delta.seq == 1:
            d["sd"] = self.seed
        return d

    def wire(self, delta: Delta) -> bytes:
        return codec.pack(self.wire_dict(delta))

    def resume_state(self) -> bytes:
        """What a later attempt needs besides the durable record (which holds tokens and text)."""
        state = {"seed": self.seed, "first_token_at": self.first_token_at, "attempt": self.attempt,
                 "started_at": self.started_at}
        if self.deadline is not None:  # what it ran of its timeout_s: a requeue does not give it back
            state["ran_s"] = self.request.timeout_s - max(0.0, self.deadline - time.monotonic())
        return codec.pack(state)

    def output(self, finish: str, error: Optional[str] = None, error_code: Optional[str] = None) -> SampleOutput:
        """This sample's output as it ends."""
        reason = self.final_reason(finish)
        return SampleOutput(index=self.sample or 0, text=self.full_text, token_ids=list(self.tokens),
                            finish_reason=reason, error=error, error_code=error_code,
                            logprobs=self.logprobs or None, tool_calls=self.tool_calls() or None,
                            reasoning=self.text.reasoning or None,
                            stop=self.text.stop_string if reason == "stop" else None,
                            embedding=self.embedding)

    def end(self, finish: str, error: Optional[str] = None, error_code: Optional[str] = None) -> Optional[Result]:
        """This sample ended: the job's result when it was the job's last sample, else None (its
        output waits in the group for the others)."""
        own = self.output(finish, error, error_code)
        if self.group is None:
            return self.result([own], self.first_token_at, self.cached_tokens, self.drafts)
        if not self.group.end(self, own):
            return None
        g = self.group
        return self.result([g.outputs[i] for i in range(g.n)], g.first_token_at, g.cached_tokens, g.drafts)

    def result(self, outputs: list[SampleOutput], first_token_at: Optional[float], cached: int,
               drafts: tuple[int, int] = (0, 0)) -> Result:
        """The job's result: sample 0's output at the top level, every sample's in ``samples`` (n > 1)."""
        finished = self.now()
        gen = sum(len(o.token_ids) for o in outputs)
        stats = JobStats(
            queued_at=self.queued_at,
            started_at=self.started_at,
            first_token_at=first_token_at,
            finished_at=finished,
            prompt_tokens=len(self.prompt),
            cached_tokens=cached,
            generated_tokens=gen,  # (the waits and rates follow: JobStats._derive)
            attempts=self.attempt,
            tier=self.tier,
            worker=self.owner.rsplit(":", 1)[0],  # the owner token is worker_id:attempt
            seed=self.seed,
            draft_proposed=drafts[0],
            draft_accepted=drafts[1],
        )
        head = outputs[0]
        return Result(id=self.id, **head.model_dump(exclude={"index"}), stats=stats,
                      samples=outputs if self.group is not None else None)


def admit_now(ready: list[ActiveJob], active: list[ActiveJob]) -> tuple[list[ActiveJob], bool]:
    """Which of the ready samples the engine takes now, and whether the worker is isolating a suspect
    (then it pulls nothing more). A suspect job (``ActiveJob.suspect``: it was in the engine of a worker
    whose serving loop raised) runs alone, so that if it fails again it fails for itself and its
    attempts count against it, not against batch-mates: while one runs, only its own samples join it;
    one that waits goes in once the engine has drained, and until then only the samples of jobs
    already running do (preempted samples of a job with n > 1)."""
    running = {j.id for j in active}
    alone = {j.id for j in active if j.suspect}
    if alone:
        return [j for j in ready if j.id in alone], True
    waiting = next((j.id for j in ready if j.suspect and j.id not in running), None)
    if waiting is None:
        return list(ready), False
    if running:
        return [j for j in ready if j.id in running], True
    return [j for j in ready if j.id == waiting], True


def call_id(job_id: str, k: int, sample: Optional[int] = None) -> str:
    """``call_`` and 24 hex digits: as random as the job id, and the same in every attempt (each
    sample of a job with n > 1 names its calls apart)."""
    key = f"{job_id}:{k}" if not sample else f"{job_id}#{sample}:{k}"
    return "call_" + hashlib.sha256(key.encode()).hexdigest()[:24]


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
    if req.embed is None and req.max_tokens > settings_max_new:
        raise JobError(f"max_tokens {req.max_tokens} exceeds this worker's limit {settings_max_new}")
    return req


def _short(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors()[:5]:
        loc = ".".join(str(x) for x in err.get("loc", ())) or "request"
        parts.append(f"{loc}: {err.get('msg')}")
    return "; ".join(parts)


def check_embedding(req: GenerateRequest, prompt_len: int, ctx: int, hidden_size: Optional[int]) -> None:
    """An embedding job fits this model: its prompt within the context, its ``dimensions`` within
    the hidden size."""
    if prompt_len > ctx:
        raise JobError(f"input of {prompt_len} tokens exceeds the model's context of {ctx} tokens")
    dims = req.embed.dimensions
    if dims is not None and hidden_size is not None and dims > hidden_size:
        raise JobError(f"dimensions {dims} exceeds this model's embedding size of {hidden_size}")


def tokenize(req: GenerateRequest, tokenizer, model_vocab: Optional[int] = None) -> list[int]:
    """The job's prompt as token ids. ``model_vocab``: the model's embedding rows, where they may be
    fewer than the tokenizer's ids (added tokens without a resize): an id past them would index the
    embedding out of bounds."""
    if req.prompt_tokens is not None:
        vocab = token_limit(tokenizer, model_vocab)
        if any(t >= vocab for t in req.prompt_tokens):
            raise JobError(f"prompt_tokens contains ids outside the vocabulary (size {vocab})")
        return list(req.prompt_tokens)
    if req.messages is not None:
        msgs = [template_message(m) for m in req.messages]
        fmt = serving_format(tokenizer)
        tools = _template_tools(req, fmt)
        if fmt.mlxq_tools and (tools or any(m["role"] == "tool" or m.get("tool_calls") for m in msgs)):
            # no tool slot in the template: mlxq describes the tools, and renders calls and results as text
            msgs, tools = own_tool_messages(msgs, req, traits(tokenizer)), None
        if not getattr(tokenizer, "chat_template", None):
            if id(tokenizer) not in _warned_no_template:
                _warned_no_template.add(id(tokenizer))
                log.warning("this model has no chat template: chat messages are sent as role-prefixed plain "
                            "text (USER: ... ASSISTANT:), as mlx-lm's server does")
            return _encode(tokenizer, plain_chat_prompt(msgs))
        try:
            ids = tokenizer.apply_chat_template(msgs, tools=tools, add_generation_prompt=True, tokenize=True)
        except Exception as exc:  # templates are user code
            raise JobError(f"chat template failed: {exc}") from None
        ids = list(ids["input_ids"] if isinstance(ids, dict) else ids)
        if not ids:  # the engine takes no empty prompt (it raised there, on the worker's MLX thread)
            raise JobError("the chat template rendered these messages as an empty prompt")
        return ids
    return _encode(tokenizer, req.prompt)


def template_message(m) -> dict:
    """A message as chat templates read it: a tool call's ``arguments`` as a mapping (mlx-lm's server
    does the same: templates render them with ``tojson``), absent fields left out."""
    d = m.model_dump(exclude_none=True)
    for call in d.get("tool_calls") or []:
        fn = call.get("function") or {}
        if isinstance(fn.get("arguments"), str):
            try:
                fn["arguments"] = json.loads(fn["arguments"])
            except ValueError:
                pass  # not JSON: the template renders the string as given
    return d


def _template_tools(req: GenerateRequest, fmt: ModelFormat) -> Optional[list[dict]]:
    """The tools the prompt describes: none for tool_choice "none"; a job its model's format cannot
    serve is refused (the gateway refuses it first)."""
    if not uses_tools(req):
        return None
    try:
        check_tools(req, fmt)
    except ConstraintError as exc:  # a ToolError
        raise JobError(str(exc)) from None
    return [t.model_dump(exclude_none=True) for t in req.tools]


def token_limit(tokenizer, model_vocab: Optional[int] = None) -> int:
    """One past the largest token id a job may name: the tokenizer's and the model's, the fewer."""
    vocab = vocab_size(tokenizer)
    return min(vocab, model_vocab) if model_vocab else vocab


def check_token_ids(req: GenerateRequest, tokenizer, model_vocab: Optional[int] = None) -> None:
    """logit_bias and resume_ids name token ids of this model's vocabulary."""
    vocab = token_limit(tokenizer, model_vocab)
    bad = sorted(t for t in (req.logit_bias or {}) if t >= vocab)
    if bad:
        raise JobError(f"logit_bias names token ids outside the vocabulary (size {vocab}): {bad[:5]}")
    bad = [t for t in (req.resume_ids or ()) if t >= vocab]
    if bad:
        raise JobError(f"resume_ids holds token ids outside the vocabulary (size {vocab}): {bad[:5]}")


def check_published_ids(published: Optional[dict], tokenizer, model_vocab: Optional[int] = None) -> None:
    """The tokens an earlier attempt published (a resume prefills them) are ids of this model's
    vocabulary: the record is only as trusted as whoever may write it (a producer under the ACL
    recipe may append to its own job's), and an id past the embedding would index it out of bounds."""
    vocab = token_limit(tokenizer, model_vocab)
    for sample, p in sorted((published or {}).items()):
        bad = [t for t in p.tokens if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            raise JobError(f"the job's durable record holds token ids outside the vocabulary (size {vocab}) "
                           f"in sample {sample}: {bad[:5]}; it cannot be resumed")


def job_grammar(req: GenerateRequest, prompt: list[int], tokenizer,
                in_thinking: Optional[bool] = None) -> Optional[str]:
    """The grammar the job's output follows (None: free text), in the model's format
    (``serving_format``); a reasoning block the prompt opened (a chat template that starts the
    answer thinking; ``in_thinking``, None: found here) comes first."""
    fmt = serving_format(tokenizer)
    if in_thinking is None:
        in_thinking = prompt_in_thinking(prompt, fmt, tokenizer)
    if in_thinking:
        fmt = dataclasses.replace(fmt, in_thinking=True)
    try:
        return grammar_for(req, fmt)
    except ConstraintError as exc:
        raise JobError(str(exc)) from None


def prompt_in_thinking(prompt: list[int], fmt: ModelFormat, tokenizer) -> bool:
    """The prompt's last reasoning marker opens a block: found by token when each marker is one, else
    in the prompt's text (a marker spelled by several tokens, which may merge with their neighbours)."""
    if not (fmt.think_start and fmt.think_end):
        return False
    if len(fmt.think_start_ids) == 1 and len(fmt.think_end_ids) == 1:
        start, end = fmt.think_start_ids[0], fmt.think_end_ids[0]
        for tok in reversed(prompt):
            if tok in (start, end):
                return tok == start
        return False
    text = decode_fn(tokenizer)(list(prompt))
    opened, closed = text.rfind(fmt.think_start), text.rfind(fmt.think_end)
    return opened >= 0 and (closed < 0 or opened >= closed + len(fmt.think_end))


def _encode(tokenizer, text: str) -> list[int]:
    ids = tokenizer.encode(text)
    if not ids:
        raise JobError("the prompt tokenizes to nothing")
    return list(ids)


def plain_chat_prompt(messages: list[dict]) -> str:
    """Chat messages as plain text for a model without a chat template (mlx-lm's ``convert_chat``)."""
    text = "".join(f"{PLAIN_CHAT_ROLES.get(m['role'], '')}{m['content']}{PLAIN_CHAT_STOP}" for m in messages)
    return (text + PLAIN_CHAT_ROLES["assistant"]).rstrip()


@dataclass
class Published:
    """What the job's durable record holds of one sample's output: the state a new attempt resumes from."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    chars: int = 0  # characters of text published
    reasoning_chars: int = 0  # characters of reasoning published
    calls: int = 0  # tool calls published
    args_chars: int = 0  # characters of the arguments of the call being written (number calls) published
    seq: int = 0  # the last delta's sequence number
    seed: Optional[int] = None
    first_token_at: Optional[float] = None  # server time of the first delta with a token
    finish: Optional[str] = None  # the sample ended (a job with n > 1: its other samples had not)
    error: Optional[str] = None
    broken: bool = False  # a gap: nothing after it is folded

    def fold(self, entry_id, d: Delta, wire: dict) -> None:
        """Add one delta, one copy of each token index."""
        if d.index > len(self.tokens) or d.offset > self.chars:
            log.warning("the durable record has a gap at token %d; resuming before it", len(self.tokens))
            self.broken = True
            return
        skip = len(self.tokens) - d.index
        if d.token_ids[skip:] and self.first_token_at is None:
            eid = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
            self.first_token_at = int(eid.split("-")[0]) / 1000.0
        self.tokens += d.token_ids[skip:]
        if d.logprobs:
            self.logprobs += d.logprobs[skip:]
        self.chars = max(self.chars, d.offset + len(d.text))
        self.reasoning_chars = max(self.reasoning_chars, d.reasoning_offset + len(d.reasoning))
        calls = d.tool_call_index + len(d.tool_calls or ())
        if calls > self.calls:
            self.calls, self.args_chars = calls, 0
        if d.partial_call_name is not None and calls == self.calls:
            self.args_chars = max(self.args_chars, d.partial_args_offset + len(d.partial_args))
        self.seq = max(self.seq, d.seq)
        self.finish, self.error = self.finish or d.finish_reason, self.error or d.error
        if self.seed is None and isinstance(wire.get("sd"), int):
            self.seed = wire["sd"]


def read_samples(entries: list, seen: Optional[Published] = None) -> dict[int, Published]:
    """Fold a job's event stream (XRANGE entries) into what each sample published (sample 0 for an
    n == 1 job), after ``seen`` (what the request says its caller has: ``seen_output``).  Terminal
    events and malformed entries are skipped; a gap (which a fenced, append-only record cannot have)
    ends that sample's fold there, so a resume never skips a token."""
    out: dict[int, Published] = {0: dataclasses.replace(seen, tokens=list(seen.tokens))} if seen else {}
    for entry_id, fields in entries:
        raw = fields.get(b"d", fields.get("d"))
        if raw is None:
            continue
        try:
            wires = wire_deltas(codec.unpack(raw))
            deltas = [Delta.from_wire(w) for w in wires]
        except (codec.CodecError, ValueError, TypeError, AttributeError):
            continue
        for d, wire in zip(deltas, wires):  # one delta, or the deltas of a job's samples of one step
            p = out.setdefault(d.sample or 0, Published())
            if not p.broken:
                p.fold(entry_id, d, wire)
    return out


def seen_output(req: GenerateRequest, prompt: list[int], tokenizer, in_thinking: Optional[bool] = None
                ) -> Optional[Published]:
    """What a resubmitted job's caller has already (``req.resume_ids``), as if an earlier attempt had
    published it: the ids, and the text, reasoning and tool calls they make (None: nothing)."""
    if not req.resume_ids:
        return None
    stream = chat_stream(tokenizer, req, prompt, in_thinking)
    text = "".join(stream.add(t) for t in req.resume_ids)
    partial = stream.partial_call()
    return Published(tokens=list(req.resume_ids), chars=len(text), reasoning_chars=len(stream.reasoning),
                     calls=len(stream.calls), args_chars=len(partial[1]) if partial else 0)


def start_job(pulled: Pulled, req: GenerateRequest, prompt: list[int], tokenizer, worker_id: str,
              clock_offset: float, published: Optional[dict[int, Published]] = None,
              grammar: Optional[str] = None, in_thinking: Optional[bool] = None) -> list[ActiveJob]:
    """A pulled job's samples still to run (one for an n == 1 job), each resumed from what it published
    (``published``: its durable record by sample) when an earlier attempt streamed part of it: a
    new attempt continues after the last published token, and never sends again what was sent.
    A sample whose end is in the record already (n > 1) waits in the group, done. ``in_thinking``:
    whether the prompt opened a reasoning block (None: found here, once for every sample)."""
    if in_thinking is None:
        in_thinking = prompt_in_thinking(prompt, chat_format(tokenizer), tokenizer)
    resume = _resume_state(pulled)
    published = published or {}
    seed = _job_seed(req, published, resume)
    group = SampleGroup(req.n) if req.n > 1 else None
    deadline = None
    if req.timeout_s is not None:  # execution time: this attempt's, plus what a requeue of it had run
        ran = resume.get("ran_s")
        ran = ran if isinstance(ran, (int, float)) and 0 <= ran <= req.timeout_s else 0.0
        deadline = time.monotonic() + req.timeout_s - ran
    samples = []
    for i in range(req.n):
        job = ActiveJob(
            id=pulled.job_id, request=req, attempt=pulled.attempt,
            owner=owner_token(worker_id, pulled.attempt), tier=pulled.tier, score=pulled.score,
            queued_at=pulled.queued_at, started_at=pulled.now, prompt=prompt, seed=seed,
            text=chat_stream(tokenizer, req, prompt, in_thinking), clock_offset=clock_offset, grammar=grammar,
            sample=i if group else None, group=group, suspect=pulled.suspect, deadline=deadline,
        )
        if isinstance(resume.get("started_at"), (int, float)):  # queue_wait_s: until the job first started
            job.started_at = resume["started_at"]
        mine = published.get(i) or Published()
        if mine.seq or mine.tokens:  # (tokens and no delta: a resubmitted job's resume_ids)
            _restore(job, mine, resume)
        if group is not None and mine.finish:
            job.full_text += job.text.finish()
            group.end(job, job.output(mine.finish, mine.error))
        else:
            samples.append(job)
    return samples


def _resume_state(pulled: Pulled) -> dict[str, Any]:
    """The requeue's resume state of this attempt ({} when there is none or it is not this attempt's)."""
    if not pulled.resume:
        return {}
    try:
        resume = codec.unpack(pulled.resume)
    except codec.CodecError:
        return {}
    return resume if isinstance(resume, dict) and resume.get("attempt") == pulled.attempt else {}


def _job_seed(req: GenerateRequest, published: dict[int, Published], resume: dict) -> int:
    """The request's seed, else the one the record (or the resume state) says the job drew."""
    if req.seed is not None:
        return req.seed
    recorded = [p.seed for p in published.values() if p.seed is not None]
    if recorded:
        return recorded[0]
    if isinstance(resume.get("seed"), int):
        return resume["seed"]
    return resolve_seed(req.params())


def _restore(job: ActiveJob, published: Published, resume: dict) -> None:
    """Rebuild a sample's text state silently; only text beyond what was published goes out."""
    job.tokens = list(published.tokens)
    job.logprobs = list(published.logprobs)
    for t in job.tokens:
        job.full_text += job.text.add(t)
    job.sent_chars = published.chars
    job.sent_reasoning = published.reasoning_chars
    job.sent_calls = published.calls
    job.sent_args = published.args_chars
    job.seq = published.seq
    job.first_token_at = resume.get("first_token_at") or published.first_token_at
    log.info("job=%s attempt=%d resumes after %d published tokens", job.uid, job.attempt, len(job.tokens))


def chat_stream(tokenizer, req: GenerateRequest, prompt: list[int], in_thinking: Optional[bool] = None) -> ChatStream:
    """The job's output stream: a chat job's answer split from its reasoning (where the model's
    template marks thinking; ``in_thinking``: the prompt opened a block, None: found here) and from
    its tool calls (when it has tools); other jobs' text as is."""
    text = TextStream.for_tokenizer(tokenizer, req.stop)
    fmt = serving_format(tokenizer)
    if req.messages is None:
        return ChatStream(text, ModelFormat())
    tools = uses_tools(req)
    return ChatStream(text, fmt, tools=tools, parse=call_parser(tokenizer, fmt),
                      tool_defs=[t.model_dump(exclude_none=True) for t in req.tools] if tools else None,
                      in_thinking=prompt_in_thinking(prompt, fmt, tokenizer) if in_thinking is None else in_thinking)
