"""OpenAI's chat/completions request and response shapes, mapped to and from mlxq's.

Requests accept unknown fields (clients send many) and ignore them; fields mlxq cannot honour
(``n`` > 1, ``echo``, ``suffix``, non-text content parts) are refused with a 400 naming the field.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

from ..shared.schemas import Result

log = logging.getLogger(__name__)


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
        loc = [str(p) for p in first.get("loc", ()) if p not in ("body",)]
        param = ".".join(loc) or None
        msg = first.get("msg", str(exc))
        return OpenAIError(400, f"{param}: {msg}" if param else msg, param=param, code="invalid_value")
    return OpenAIError(400, str(exc), code="invalid_value")


class _Params(BaseModel):
    """Sampling fields shared by both endpoints (OpenAI names; vLLM-style extras accepted)."""

    model_config = ConfigDict(extra="allow")
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

    def check_common(self) -> None:
        if self.n is not None and self.n != 1:
            raise OpenAIError(400, "only n=1 is supported", param="n", code="unsupported_value")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))

    def sampling(self) -> dict[str, Any]:
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        out = dict(temperature=self.temperature, top_p=self.top_p, seed=self.seed, stop=stop or None,
                   top_k=self.top_k, min_p=self.min_p, repetition_penalty=self.repetition_penalty,
                   ignore_eos=self.ignore_eos)
        return {k: v for k, v in out.items() if v is not None}


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: Optional[Union[StrictStr, list[dict]]] = None

    def to_mlxq(self, index: int) -> dict:
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
        return {"role": role, "content": content or ""}


class ChatCompletionRequest(_Params):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[StrictInt] = Field(None, ge=1)
    logprobs: Optional[bool] = None
    top_logprobs: Optional[StrictInt] = Field(None, ge=0, le=20)

    def submit_kwargs(self) -> dict[str, Any]:
        self.check_common()
        kw = self.sampling()
        max_tokens = self.max_completion_tokens or self.max_tokens
        if max_tokens is not None:
            kw["max_tokens"] = max_tokens
        if self.logprobs:
            kw["logprobs"] = max(1, self.top_logprobs or 0)
        kw["messages"] = [m.to_mlxq(i) for i, m in enumerate(self.messages)]
        return kw

    @property
    def top_n(self) -> int:
        return (self.top_logprobs or 0) if self.logprobs else 0


class CompletionRequest(_Params):
    prompt: Union[StrictStr, list[StrictStr], list[StrictInt], list[list[StrictInt]]]
    max_tokens: Optional[StrictInt] = Field(16, ge=1)  # OpenAI's default for this endpoint
    logprobs: Optional[StrictInt] = Field(None, ge=0, le=20)
    echo: Optional[bool] = None
    suffix: Optional[StrictStr] = None

    def submit_kwargs(self) -> dict[str, Any]:
        self.check_common()
        if self.echo:
            raise OpenAIError(400, "echo is not supported", param="echo", code="unsupported_value")
        if self.suffix:
            raise OpenAIError(400, "suffix is not supported", param="suffix", code="unsupported_value")
        kw = self.sampling()
        kw["max_tokens"] = self.max_tokens
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


def finish_reason(reason: Optional[str]) -> Optional[str]:
    return reason  # stop | length | cancelled (mlxq's own; OpenAI has no word for it)


class TokenNames:
    """Token id -> text for logprobs, from the model directory's tokenizer.json when the gateway
    can read it (same host or shared volume); otherwise ``"<id>"``."""

    def __init__(self):
        self._cache: dict[str, Any] = {}

    def tokenizer(self, info: Optional[dict]):
        """The model's ``tokenizers.Tokenizer`` when its directory is readable here, else None."""
        source = (info or {}).get("source") or ""
        if source not in self._cache:
            self._cache[source] = None
            path = os.path.join(source, "tokenizer.json") if source else ""
            if path and os.path.isfile(path):
                try:
                    from tokenizers import Tokenizer

                    self._cache[source] = Tokenizer.from_file(path)
                except Exception as exc:
                    log.warning("cannot load %s (%s): logprobs show token ids, prompt lengths are checked "
                                "by the worker", path, exc)
        return self._cache[source]

    def counter(self, info: Optional[dict]):
        """``text -> prompt token count`` (as the worker encodes a prompt), or None."""
        tok = self.tokenizer(info)
        return (lambda text: len(tok.encode(text).ids)) if tok is not None else None

    def for_model(self, info: Optional[dict]):
        tok = self.tokenizer(info)
        return (lambda i: tok.decode([i])) if tok is not None else (lambda i: f"<{i}>")


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
            tops = [{"token": self.name(i), "logprob": v, "bytes": list(self.name(i).encode())}
                    for i, v in (e.get("top") or [])[: self.top_n]]
            content.append({"token": s, "logprob": e.get("logprob"), "bytes": list(s.encode()), "top_logprobs": tops})
        return {"content": content}

    def completion(self, entries: Optional[list], offset: int = 0) -> Optional[dict]:
        if entries is None:
            return None
        tokens, lps, tops, offsets = [], [], [], []
        for e in entries:
            s = self.name(e["token"])
            tokens.append(s)
            lps.append(e.get("logprob"))
            tops.append({self.name(i): v for i, v in (e.get("top") or [])[: self.top_n]})
            offsets.append(offset)
            offset += len(s)
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def now_s() -> int:
    return int(time.time())
