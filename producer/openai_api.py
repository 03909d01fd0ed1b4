"""OpenAI's chat/completions request and response shapes, mapped to and from mlxq's.

Every parameter that would change the output is honoured or refused with a 400 that names it:
``response_format``, ``tools``/``tool_choice``/``parallel_tool_calls``, ``presence_penalty``,
``frequency_penalty``, ``logit_bias`` and ``n`` (choices: the job's samples) go to the job; ``echo``, ``suffix``, non-text
content parts and any field mlxq does not know are refused.  Harmless metadata (:data:`HARMLESS`:
``user``, ``metadata``, ``store``...) passes, logged once per field.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

from ..shared.schemas import Delta, Result, SampleOutput

log = logging.getLogger(__name__)

# fields that do not change what the model generates: accepted and not used (logged once each)
HARMLESS = frozenset({"user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier"})
_logged_harmless: set[str] = set()
_harmless_lock = threading.Lock()


class OpenAIError(Exception):
    """An error answered in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def validation_error(exc) -> OpenAIError:
    """A pydantic ValidationError (or plain ValueError) as a 400 naming the first bad field."""
    errors = getattr(exc, "errors", None)
    if callable(errors):
        first = exc.errors()[0]
        loc = [str(p) for p in first.get("loc", ()) if p not in ("body",) and not _union_tag(p)]
        param = ".".join(loc) or _param_of(first.get("ctx", {}).get("error"))
        msg = first.get("msg", str(exc)).removeprefix("Value error, ")
        return OpenAIError(400, f"{param}: {msg}" if loc else msg, param=param, code="invalid_value")
    return OpenAIError(400, str(exc), param=_param_of(exc), code="invalid_value")


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "dict", "list", "none", "bytes"})


def _union_tag(part) -> bool:
    """Whether a pydantic error location part names the member of a union it tried ('str',
    "list[dict[any,any]]", "literal['none','auto','required']"), not a request field."""
    return isinstance(part, str) and ("[" in part or part in _TYPE_TAGS)


def _param_of(exc) -> Optional[str]:
    """The request field a request-level error is about, when its message starts with it
    ("tool_choice names...", "tools: ...", "response_format...")."""
    text = str(exc or "")
    for name in ("tool_choice", "tools", "response_format", "logit_bias"):
        if text.startswith(name):
            return name
    return None


def unsupported(param: str, why: str = "") -> OpenAIError:
    return OpenAIError(400, f"{param} is not supported{': ' + why if why else ''}", param=param,
                       code="unsupported_parameter")


class _Params(BaseModel):
    """Sampling fields shared by both endpoints (OpenAI names; vLLM-style extras accepted)."""

    model_config = ConfigDict(extra="allow")
    STREAM_OPTIONS: ClassVar[tuple[str, ...]] = ("include_usage",)  # what stream_options may hold
    model: Optional[StrictStr] = None
    max_tokens: Optional[StrictInt] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
    seed: Optional[StrictInt] = None
    stop: Optional[Union[StrictStr, list[StrictStr]]] = None
    n: Optional[StrictInt] = None
    stream: bool = False
    stream_options: Optional[dict] = None
    # extensions (as vLLM names them)
    top_k: Optional[StrictInt] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    ignore_eos: Optional[bool] = None
    # OpenAI's penalties and bias, and an output constraint (mlxq.shared.constraints)
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, float]] = None
    response_format: Optional[dict[str, Any]] = None
    timeout_s: Any = None  # mlxq's: the job's time limit (checked with the request, GenerateRequest)
    # mlxq's: a job's life (docs/pipelines/job-life.md), checked at submit (a time past, a webhook host not allowed: 400)
    run_at: Any = None
    defer_s: Any = None
    expires_at: Any = None
    expires_in: Any = None
    webhook: Any = None

    def check_common(self) -> None:
        for name, value in (self.model_extra or {}).items():
            if name in HARMLESS:
                _log_harmless(name)
            elif value is not None:
                raise unsupported(name, "mlxq does not implement it, and it would change the output")
        if self.stream_options is not None and not self.stream:
            raise OpenAIError(400, "stream_options is only allowed when stream is true", param="stream_options",
                              code="invalid_value")
        for name, value in (self.stream_options or {}).items():  # what the stream carries
            if name not in self.STREAM_OPTIONS and value is not None:
                raise unsupported(f"stream_options.{name}", f"only {', '.join(self.STREAM_OPTIONS)} is implemented")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))

    def sampling(self) -> dict[str, Any]:
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        out = dict(temperature=self.temperature, top_p=self.top_p, seed=self.seed, stop=stop or None,
                   top_k=self.top_k, min_p=self.min_p, repetition_penalty=self.repetition_penalty,
                   ignore_eos=self.ignore_eos, presence_penalty=self.presence_penalty,
                   frequency_penalty=self.frequency_penalty, logit_bias=_token_bias(self.logit_bias),
                   response_format=self.response_format, n=self.n, timeout_s=self.timeout_s,
                   run_at=self.run_at, defer_s=self.defer_s, expires_at=self.expires_at, expires_in=self.expires_in,
                   webhook=self.webhook)
        return {k: v for k, v in out.items() if v is not None}


def _token_bias(bias: Optional[dict[str, float]]) -> Optional[dict[int, float]]:
    """OpenAI's ``logit_bias`` (token id strings -> bias) with int keys."""
    if not bias:
        return None
    try:
        return {int(k): v for k, v in bias.items()}
    except ValueError:
        raise OpenAIError(400, "logit_bias: keys must be token ids", param="logit_bias",
                          code="invalid_value") from None


def check_bias_vocab(kwargs: dict, info: Optional[dict]) -> None:
    """A ``logit_bias`` id outside the model's vocabulary (when its size is known): a 400."""
    vocab = int((info or {}).get("vocab_size") or 0)
    bad = [t for t in kwargs.get("logit_bias") or () if vocab and t >= vocab]
    if bad:
        raise OpenAIError(400, f"logit_bias: token id {bad[0]} is outside the vocabulary (size {vocab})",
                          param="logit_bias", code="invalid_value")


def _log_harmless(name: str) -> None:
    with _harmless_lock:
        if name in _logged_harmless:
            return
        _logged_harmless.add(name)
    log.info("request field %r is accepted and not used (it does not change the output); logged once", name)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: Optional[Union[StrictStr, list[dict]]] = None
    name: Optional[StrictStr] = None
    tool_calls: Optional[list[dict]] = None  # an assistant's calls, as the API returned them
    tool_call_id: Optional[StrictStr] = None  # a tool message: the call it answers
    refusal: Optional[StrictStr] = None  # an assistant message as returned: dropped
    # an assistant message as this gateway returns it (a model that thinks): dropped, so that the
    # usual loop (append the reply's message, ask again) works; chat templates that keep earlier
    # turns' thoughts (Qwen3's, DeepSeek-R1's) leave them out before the last user message anyway
    reasoning_content: Optional[StrictStr] = None
    reasoning: Optional[StrictStr] = None

    def to_mlxq(self, index: int) -> dict:
        for name, value in (self.model_extra or {}).items():
            if value is not None:
                raise unsupported(f"messages.{index}.{name}")
        for name in ("reasoning_content", "reasoning"):
            if getattr(self, name) is not None and self.role != "assistant":
                raise unsupported(f"messages.{index}.{name}", "only an assistant message carries it")
        role = {"developer": "system", "function": "tool"}.get(self.role, self.role)
        content = self.content
        if isinstance(content, list):
            parts = []
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise OpenAIError(400, "only text content parts are supported",
                                      param=f"messages.{index}.content", code="unsupported_value")
                parts.append(part["text"])
            content = "".join(parts)
        out = {"role": role, "content": content or "", "name": self.name, "tool_call_id": self.tool_call_id,
               "tool_calls": self.tool_calls}
        return {k: v for k, v in out.items() if v is not None}


class ChatCompletionRequest(_Params):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[StrictInt] = Field(None, ge=1)
    logprobs: Optional[bool] = None
    top_logprobs: Optional[StrictInt] = Field(None, ge=0, le=20)
    tools: Optional[list[dict]] = None
    tool_choice: Optional[Union[StrictStr, dict]] = None
    parallel_tool_calls: Optional[bool] = None
    functions: Optional[list[dict]] = None  # OpenAI's deprecated forms of tools: refused
    function_call: Optional[Union[StrictStr, dict]] = None

    def submit_kwargs(self) -> dict[str, Any]:
        self.check_common()
        for old, new in (("functions", "tools"), ("function_call", "tool_choice")):
            if getattr(self, old) is not None:
                raise unsupported(old, f"the deprecated form; send {new}")
        kw = self.sampling()
        kw.update({k: v for k, v in (("tools", self.tools), ("tool_choice", self.tool_choice),
                                     ("parallel_tool_calls", self.parallel_tool_calls)) if v is not None})
        max_tokens = self.max_completion_tokens or self.max_tokens
        if max_tokens is not None:
            kw["max_tokens"] = max_tokens
        if self.logprobs:
            kw["logprobs"] = max(1, self.top_logprobs or 0)
        elif self.top_logprobs:  # as OpenAI: it asks for alternatives of logprobs that were not asked for
            raise OpenAIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        kw["messages"] = [m.to_mlxq(i) for i, m in enumerate(self.messages)]
        return kw

    @property
    def top_n(self) -> int:
        return (self.top_logprobs or 0) if self.logprobs else 0


class CompletionRequest(_Params):
    prompt: Union[StrictStr, list[StrictStr], list[StrictInt], list[list[StrictInt]]]
    max_tokens: Optional[StrictInt] = Field(16, ge=1)  # OpenAI's default for this endpoint, null too
    logprobs: Optional[StrictInt] = Field(None, ge=0, le=20)
    echo: Optional[bool] = None
    suffix: Optional[StrictStr] = None
    best_of: Optional[StrictInt] = None

    def submit_kwargs(self) -> dict[str, Any]:
        self.check_common()
        if self.best_of is not None and self.best_of != 1:
            raise OpenAIError(400, "only best_of=1 is supported", param="best_of", code="unsupported_value")
        if self.echo:
            raise OpenAIError(400, "echo is not supported", param="echo", code="unsupported_value")
        if self.suffix:
            raise OpenAIError(400, "suffix is not supported", param="suffix", code="unsupported_value")
        kw = self.sampling()
        # null is the default too, as OpenAI's API takes it (not a run to the context's end)
        kw["max_tokens"] = 16 if self.max_tokens is None else self.max_tokens
        if self.logprobs is not None:
            kw["logprobs"] = max(1, self.logprobs)
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise OpenAIError(400, "one prompt per request (use mlxq batch or Client.map for many)",
                                  param="prompt", code="unsupported_value")
            prompt = prompt[0]
        if isinstance(prompt, list):
            if not prompt:
                raise OpenAIError(400, "prompt must not be empty", param="prompt", code="invalid_value")
            kw["prompt_tokens"] = prompt
        else:
            kw["prompt"] = prompt
        return kw

    @property
    def top_n(self) -> int:
        return self.logprobs or 0


# -- responses -------------------------------------------------------------------------------

def usage(res: Result) -> dict:
    """OpenAI's usage object; ``cached_tokens``: prompt tokens served from the prefix cache."""
    u = res.usage
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.total_tokens, "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}


def finish_fields(reason: Optional[str]) -> dict[str, Optional[str]]:
    """A choice's ``finish_reason`` for mlxq's: stop | length | tool_calls as they are, cancelled and
    error as mlxq's own words (OpenAI has none); a job past its ``timeout_s`` ends as OpenAI's
    clients know a cut-short answer, "length", and ``mlxq_finish_reason`` says why."""
    if reason == "timeout":
        return {"finish_reason": "length", "mlxq_finish_reason": "timeout"}
    return {"finish_reason": reason}


def chat_message(res: Union[Result, SampleOutput]) -> dict:
    """The assistant message of a finished chat job (or of one of its samples): its answer (None when
    it only made calls), its calls and its reasoning, as vLLM and mlx-lm's server return them."""
    # a call-only answer is None, as OpenAI's: the line between parallel calls is no answer
    text = res.text if res.text and (res.text.strip() or not res.tool_calls) else ""
    msg: dict[str, Any] = {"role": "assistant", "content": text or (None if res.tool_calls else "")}
    if res.tool_calls:
        msg["tool_calls"] = [c.model_dump() for c in res.tool_calls]
    if res.reasoning:
        msg["reasoning_content"] = res.reasoning
    return msg


@dataclass
class ChatDeltas:
    """A chat stream's deltas in OpenAI's chunk shape: the answer as ``content``, the reasoning as
    ``reasoning_content``, and the calls as OpenAI streams them: a call's first ``tool_calls`` entry
    has its index, id, type and name, the next ones more of its ``arguments`` as the model writes
    them (a call that did not stream comes whole), which the openai library's stream helpers
    reassemble.  Reasoning, calls and arguments are kept once each by their absolute positions, as
    ``StreamState`` keeps tokens and text."""

    reasoning: int = 0  # reasoning characters sent
    calls: int = 0  # calls ended and sent
    opened: int = -1  # the call whose arguments are streaming (its index), -1: none
    args: int = 0  # characters of its arguments sent

    def delta(self, d: Delta) -> dict:
        out: dict[str, Any] = {}
        reasoning = d.reasoning[max(0, self.reasoning - d.reasoning_offset):]
        if reasoning:
            out["reasoning_content"] = reasoning
            self.reasoning = d.reasoning_offset + len(d.reasoning)
        if d.text:
            out["content"] = d.text
        calls = [self._ended(d.tool_call_index + i, c) for i, c in enumerate(d.tool_calls or ())
                 if d.tool_call_index + i >= self.calls]
        self.calls = max(self.calls, d.tool_call_index + len(d.tool_calls or ()))
        if d.partial_call_name is not None and self.calls <= (k := d.tool_call_index + len(d.tool_calls or ())):
            calls.append(self._streaming(k, d))
        calls = [c for c in calls if c is not None]
        if calls:
            out["tool_calls"] = calls
        return out

    def _ended(self, k: int, call) -> Optional[dict]:
        """A call that ended: whole, or the rest of its arguments when they were streaming."""
        if k != self.opened:
            return {"index": k, **call.model_dump()}
        rest = call.function.get("arguments", "")[self.args:]
        self.opened, self.args = -1, 0
        return {"index": k, "function": {"arguments": rest}} if rest else None

    def _streaming(self, k: int, d: Delta) -> Optional[dict]:
        """More of the arguments of call ``k``, headed by its id and name the first time."""
        entry: dict[str, Any] = {"index": k}
        if k != self.opened:
            self.opened, self.args = k, 0
            entry.update(id=d.partial_call_id, type="function", function={"name": d.partial_call_name})
        piece = d.partial_args[max(0, self.args - d.partial_args_offset):]
        self.args = max(self.args, d.partial_args_offset + len(d.partial_args))
        if not piece and "id" not in entry:
            return None
        entry.setdefault("function", {})["arguments"] = piece
        return entry


class TokenNames:
    """Token id -> text for logprobs, from the model directory's tokenizer.json when the gateway
    can read it (same host or shared volume); otherwise ``"<id>"``."""

    def __init__(self):
        self._cache: dict[str, Any] = {}
        # one load per model, whichever thread asks first; the others wait for it (the gateway loads
        # on a worker thread: a large tokenizer.json held its event loop, every stream, ~0.1-1 s)
        self._lock = threading.Lock()

    def tokenizer(self, info: Optional[dict]):
        """The model's ``tokenizers.Tokenizer`` when its directory is readable here, else None."""
        source = (info or {}).get("source") or ""
        with self._lock:
            if source not in self._cache:
                self._cache[source] = self._load(source)
            return self._cache[source]

    def loaded(self, info: Optional[dict]) -> bool:
        """Whether ``tokenizer(info)`` returns at once (the model's file already read, or unreadable)."""
        return ((info or {}).get("source") or "") in self._cache

    @staticmethod
    def _load(source: str):
        path = os.path.join(source, "tokenizer.json") if source else ""
        if not (path and os.path.isfile(path)):
            return None
        try:
            from tokenizers import Tokenizer

            return Tokenizer.from_file(path)
        except Exception as exc:
            log.warning("cannot load %s (%s): logprobs show token ids, prompt lengths are checked "
                        "by the worker", path, exc)
            return None

    def counter(self, info: Optional[dict]):
        """``text -> prompt token count`` (as the worker encodes a prompt), or None."""
        tok = self.tokenizer(info)
        # encode_batch: the same ids as encode, and it lets go of the GIL while it works (encode holds
        # it: a 4 MiB prompt kept every other thread of the gateway waiting ~4 s, measured)
        return (lambda text: len(tok.encode_batch([text])[0].ids)) if tok is not None else None

    def for_model(self, info: Optional[dict]):
        tok = self.tokenizer(info)
        # special tokens kept, as the worker's text keeps them (an EOS under ignore_eos): skipped, a
        # special token's name would be "", and the names would not join to the text nor text_offset to it
        return (lambda i: tok.decode([i], skip_special_tokens=False)) if tok is not None else (lambda i: f"<{i}>")


# What a token the sampler could not draw (logprob -inf: a grammar's mask, a logit_bias of -100 and
# less) is shown as: JSON has no -Infinity, so strict parsers refused the stream and the reply
# could not be written at all (a 500). vLLM's OpenAI server shows -9999.0 too.
MIN_LOGPROB = -9999.0


def finite(logprob: Optional[float]) -> Optional[float]:
    """A logprob as JSON can carry it: -inf (or NaN) as MIN_LOGPROB, None kept."""
    if logprob is None or logprob > MIN_LOGPROB:
        return logprob
    return MIN_LOGPROB


@dataclass
class LogprobFormatter:
    """mlxq logprob entries ({token, logprob, top: [[id, lp]]}) in OpenAI's two shapes."""

    name: Any  # callable id -> str
    top_n: int

    def chat(self, entries: Optional[list]) -> Optional[dict]:
        if entries is None:
            return None
        content = []
        for e in entries:
            s = self.name(e["token"])
            tops = [{"token": self.name(i), "logprob": finite(v), "bytes": list(self.name(i).encode())}
                    for i, v in (e.get("top") or [])[: self.top_n]]
            content.append({"token": s, "logprob": finite(e.get("logprob")), "bytes": list(s.encode()),
                            "top_logprobs": tops})
        return {"content": content}

    def completion(self, entries: Optional[list], offset: int = 0) -> Optional[dict]:
        if entries is None:
            return None
        tokens, lps, tops, offsets = [], [], [], []
        for e in entries:
            s = self.name(e["token"])
            tokens.append(s)
            lps.append(finite(e.get("logprob")))
            tops.append({self.name(i): finite(v) for i, v in (e.get("top") or [])[: self.top_n]})
            offsets.append(offset)
            offset += len(s)
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def failed_output(res: Result) -> Optional[SampleOutput]:
    """The first of a finished job's outputs that failed, or None: any sample's failure is the
    request's (the gateway's reply and ``mlxq batch``'s line), as a stream ends with it."""
    return next((out for out in res.outputs if out.finish_reason == "error"), None)


def choice(chat: bool, out: SampleOutput, fmt: LogprobFormatter) -> dict:
    """One choice of a finished job: its sample ``out``'s output, in OpenAI's chat or completion shape
    (the gateway's replies and ``mlxq batch``'s output lines)."""
    if chat:
        return {"index": out.index, "message": chat_message(out),
                "logprobs": fmt.chat(out.logprobs) if fmt.top_n or out.logprobs else None,
                **finish_fields(out.finish_reason)}
    return {"index": out.index, "text": out.text, "logprobs": fmt.completion(out.logprobs),
            **finish_fields(out.finish_reason)}


def now_s() -> int:
    return int(time.time())
