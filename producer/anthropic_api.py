"""Anthropic's Messages request and response shapes, mapped to and from mlxq's.

A request becomes ``AsyncClient.submit``'s kwargs: ``system`` and ``messages`` (text, ``tool_use`` and
``tool_result`` blocks) as mlxq chat messages, ``tools`` and ``tool_choice`` as the function tools
and choice the Chat Completions path takes (one grammar and one check for both APIs), the sampling
fields by their mlxq names.  What mlxq cannot honour is refused with a 400 that names it (image and
document blocks, Anthropic's server tools, unknown fields); what does not change the output passes
(``metadata``, ``cache_control``, ``service_tier``; ``thinking``: a model that thinks always does,
one that does not never will).

Errors are Anthropic's shape (``error_body``): ``{"type": "error", "error": {"type", "message"}}``.
"""

from __future__ import annotations

import json
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from ..shared.schemas import Result, SampleOutput
from .openai_api import OpenAIError, _log_harmless, _token_bias, chat_message, unsupported

# the fields of a request that do not change what the model generates: accepted, not used
# (``cache_control``: the prefix cache keeps every prompt's blocks without being asked)
HARMLESS = frozenset({"metadata", "service_tier", "cache_control", "speed", "inference_geo", "user_profile_id",
                      "workspace_id", "diagnostics"})
# mlxq's extensions, by the names the Chat Completions API takes them (vLLM's)
EXTENSIONS = ("seed", "min_p", "repetition_penalty", "ignore_eos", "timeout_s")

# an HTTP status -> Anthropic's error type (a 4xx not named here: invalid_request_error; a 5xx: api_error)
ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
               413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def error_body(exc: OpenAIError) -> dict:
    """``exc`` in Anthropic's error shape."""
    kind = ERROR_TYPES.get(exc.status, "api_error" if exc.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": exc.message}}


class InMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["user", "assistant"]
    content: Union[StrictStr, list[dict]]


class PromptRequest(BaseModel):
    """What makes the prompt: the body of ``/v1/messages/count_tokens``, and of a message with
    the sampling fields (:class:`MessagesRequest`)."""

    model_config = ConfigDict(extra="allow")
    model: Optional[StrictStr] = None
    messages: list[InMessage] = Field(min_length=1)
    system: Optional[Union[StrictStr, list[dict]]] = None
    tools: Optional[list[dict]] = None
    tool_choice: Optional[dict] = None
    thinking: Optional[dict] = None
    output_config: Optional[dict] = None

    def prompt_kwargs(self) -> dict[str, Any]:
        for name, value in (self.model_extra or {}).items():
            if name in HARMLESS:
                _log_harmless(name)
            elif value is not None and name not in EXTENSIONS:
                raise unsupported(name, "mlxq does not implement it")
        _check_thinking(self.thinking)
        kw: dict[str, Any] = {"messages": mlxq_messages(self.system, self.messages)}
        if self.tools is not None:
            kw["tools"] = [_tool(i, t) for i, t in enumerate(self.tools)]
        if self.tool_choice is not None:
            kw.update(_tool_choice(self.tool_choice))
        fmt = _output_format(self.output_config)
        if fmt is not None:
            kw["response_format"] = fmt
        return kw


class MessagesRequest(PromptRequest):
    max_tokens: StrictInt = Field(ge=1)  # required, as Anthropic's API has it
    temperature: Optional[float] = Field(None, ge=0.0, le=1.0)
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
    top_k: Optional[StrictInt] = Field(None, ge=0)
    stop_sequences: Optional[list[StrictStr]] = None
    stream: StrictBool = False
    logit_bias: Optional[dict[str, float]] = None  # mlxq's extension, as Chat Completions takes it

    def submit_kwargs(self) -> dict[str, Any]:
        kw = self.prompt_kwargs()
        extra = {name: (self.model_extra or {}).get(name) for name in EXTENSIONS}
        fields = dict(max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                      stop=self.stop_sequences or None, logit_bias=_token_bias(self.logit_bias), **extra)
        kw.update({k: v for k, v in fields.items() if v is not None})
        return kw


THINKING = ("enabled", "disabled", "adaptive", "between_tools")


def _output_format(config: Optional[dict]) -> Optional[dict]:
    """``output_config``: its ``format`` (a JSON schema the answer is held to) as the job's
    ``response_format``; ``effort`` and ``task_budget`` are accepted, as ``thinking`` is."""
    if not config:
        return None
    unknown = sorted(set(config) - {"format", "effort", "task_budget"})
    if unknown:
        raise unsupported(f"output_config.{unknown[0]}")
    fmt = config.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise OpenAIError(400, "output_config.format: {\"type\": \"json_schema\", \"schema\": {...}} is required",
                          param="output_config.format", code="invalid_value")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"], "strict": True}}


def _check_thinking(thinking: Optional[dict]) -> None:
    """``thinking`` is accepted in Anthropic's forms: a model that thinks (its template opens a thought)
    thinks whatever it says, and its thought streams as ``thinking`` blocks; one that does not, never
    will.  ``budget_tokens`` bounds nothing apart from ``max_tokens``."""
    if thinking is None:
        return
    kind = thinking.get("type")
    if kind not in THINKING:
        raise OpenAIError(400, f"thinking.type must be one of {', '.join(THINKING)}, not {kind!r}",
                          param="thinking.type", code="invalid_value")
    budget = thinking.get("budget_tokens")
    if kind == "enabled" and (not isinstance(budget, int) or isinstance(budget, bool) or budget < 1):
        raise OpenAIError(400, "thinking.budget_tokens: a positive integer is required with type 'enabled'",
                          param="thinking.budget_tokens", code="invalid_value")
    _log_harmless("thinking")


# -- the prompt ----------------------------------------------------------------------------------

def mlxq_messages(system: Union[str, list[dict], None], messages: list[InMessage]) -> list[dict]:
    """``system`` and ``messages`` as mlxq chat messages: an assistant turn's ``tool_use`` blocks are
    its ``tool_calls``, each ``tool_result`` block a ``tool`` message (named after the call it
    answers), in the order the blocks come; thinking blocks of earlier turns are dropped, as the
    Chat Completions path drops ``reasoning_content``."""
    out: list[dict] = []
    if system:
        out.append({"role": "system", "content": system if isinstance(system, str) else _text(system, "system")})
    names: dict[str, str] = {}  # tool_use id -> its function's name
    for i, m in enumerate(messages):
        blocks = [{"type": "text", "text": m.content}] if isinstance(m.content, str) else m.content
        text: list[str] = []
        calls: list[dict] = []
        for j, block in enumerate(blocks):
            where, kind = f"messages.{i}.content.{j}", block.get("type")
            if kind == "text":
                text.append(_block_text(block, where))
            elif kind == "tool_use" and m.role == "assistant":
                calls.append(_call(block, where))
                names[calls[-1]["id"]] = calls[-1]["function"]["name"]
            elif kind == "tool_result" and m.role == "user":
                if text:  # text before a result stays before it
                    out.append({"role": "user", "content": "\n".join(text)})
                    text = []
                out.append(_result(block, where, names))
            elif kind in ("thinking", "redacted_thinking") and m.role == "assistant":
                continue
            elif kind in ("image", "document", "search_result"):
                raise unsupported(where, f"{kind} blocks: mlxq serves text models")
            else:
                raise OpenAIError(400, f"{where}: a {kind!r} block is not supported in a {m.role} message",
                                  param=where, code="unsupported_value")
        if m.role == "assistant":
            msg = {"role": "assistant", "content": "\n".join(text)}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
        elif text or isinstance(m.content, str):
            out.append({"role": "user", "content": "\n".join(text)})
    return out


def _block_text(block: dict, where: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise OpenAIError(400, f"{where}.text: a string is required", param=f"{where}.text", code="invalid_value")
    return text


def _text(blocks: list[dict], where: str) -> str:
    """Text blocks (a system prompt, a tool result's content) as one text."""
    parts = []
    for j, block in enumerate(blocks):
        if not isinstance(block, dict) or block.get("type") != "text":
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise OpenAIError(400, f"{where}.{j}: only text blocks are supported here (got {kind!r})",
                              param=f"{where}.{j}", code="unsupported_value")
        parts.append(_block_text(block, f"{where}.{j}"))
    return "\n".join(parts)


def _call(block: dict, where: str) -> dict:
    """A ``tool_use`` block as an mlxq tool call (``arguments``: its ``input`` as JSON)."""
    call_id, name, args = block.get("id"), block.get("name"), block.get("input", {})
    if not isinstance(call_id, str) or not isinstance(name, str) or not isinstance(args, dict):
        raise OpenAIError(400, f"{where}: a tool_use block needs a string id and name and an object input",
                          param=where, code="invalid_value")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


def _result(block: dict, where: str, names: dict[str, str]) -> dict:
    """A ``tool_result`` block as an mlxq tool message (``is_error``: the content says what failed)."""
    call_id, content = block.get("tool_use_id"), block.get("content", "")
    if not isinstance(call_id, str):
        raise OpenAIError(400, f"{where}.tool_use_id: a string is required", param=f"{where}.tool_use_id",
                          code="invalid_value")
    if isinstance(content, list):
        content = _text(content, f"{where}.content")
    elif not isinstance(content, str):
        raise OpenAIError(400, f"{where}.content: a string or text blocks are required", param=f"{where}.content",
                          code="invalid_value")
    msg = {"role": "tool", "tool_call_id": call_id, "content": content}
    if call_id in names:
        msg["name"] = names[call_id]
    return msg


TOOL_FIELDS = frozenset({"type", "name", "description", "input_schema", "strict", "cache_control"})


def _tool(i: int, tool: dict) -> dict:
    """An Anthropic tool (a client tool: name, description, input_schema) as a function tool."""
    kind = tool.get("type")
    if kind not in (None, "custom"):  # web_search_..., bash_..., text_editor_..., computer_...
        raise unsupported(f"tools.{i}", f"{kind!r} is one of Anthropic's server tools; mlxq serves client "
                                        "tools (name, description, input_schema)")
    unknown = sorted(set(tool) - TOOL_FIELDS)
    if unknown:
        raise unsupported(f"tools.{i}.{unknown[0]}")
    fn = {k: v for k, v in (("name", tool.get("name")), ("description", tool.get("description")),
                            ("parameters", tool.get("input_schema")), ("strict", tool.get("strict")))
          if v is not None}
    return {"type": "function", "function": fn}


def _tool_choice(choice: dict) -> dict[str, Any]:
    """Anthropic's ``tool_choice`` as mlxq's ``tool_choice`` and ``parallel_tool_calls``."""
    kind = choice.get("type")
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise OpenAIError(400, "tool_choice: type 'tool' needs the tool's name", param="tool_choice.name",
                              code="invalid_value")
        out: dict[str, Any] = {"tool_choice": {"type": "function", "function": {"name": choice["name"]}}}
    elif kind in ("auto", "any", "none"):
        out = {"tool_choice": {"auto": "auto", "any": "required", "none": "none"}[kind]}
    else:
        raise OpenAIError(400, f"tool_choice.type must be 'auto', 'any', 'tool' or 'none', not {kind!r}",
                          param="tool_choice.type", code="invalid_value")
    unknown = sorted(set(choice) - {"type", "name", "disable_parallel_tool_use"})
    if unknown:
        raise unsupported(f"tool_choice.{unknown[0]}")
    if choice.get("disable_parallel_tool_use"):
        out["parallel_tool_calls"] = False
    return out


# -- the answer ----------------------------------------------------------------------------------

def content_blocks(out: SampleOutput) -> list[dict]:
    """A finished job's output as content blocks: its thought, its answer (none when it only made
    calls, as ``chat_message`` has it), its calls."""
    msg = chat_message(out)
    blocks = []
    if msg.get("reasoning_content"):
        blocks.append({"type": "thinking", "thinking": msg["reasoning_content"], "signature": ""})
    # before calls, the line that leads to them is no answer either (a stream drops it: BlockEvents)
    text = (msg["content"] or "").rstrip() if msg.get("tool_calls") else msg["content"]
    if text:
        blocks.append({"type": "text", "text": text})
    blocks += [tool_use(call["id"], call["function"]["name"], call["function"]["arguments"])
               for call in msg.get("tool_calls") or ()]
    return blocks


def tool_use(call_id: str, name: str, arguments: str) -> dict:
    return {"type": "tool_use", "id": call_id, "name": name, "input": tool_input(arguments)}


def tool_input(arguments: str) -> dict:
    """A call's arguments as the object ``input`` is.  A family whose calls are parsed, not enforced,
    may write arguments that are not an object: they stay whole, under ``arguments``."""
    try:
        value = json.loads(arguments)
    except ValueError:
        value = None
    return value if isinstance(value, dict) else {"arguments": arguments}


def stop_fields(out: Union[Result, SampleOutput], max_tokens: int) -> dict[str, Optional[str]]:
    """``stop_reason`` and ``stop_sequence`` of a finished output.  An output cut short before
    ``max_tokens`` ran out of room (the worker caps a job where its KV pool would end); a job past its
    ``timeout_s`` reads as cut short and a cancelled one as ended, with ``mlxq_stop_reason`` saying
    which (Anthropic has no word for them)."""
    reason, stop = out.finish_reason, None
    if reason == "tool_calls":
        kind = "tool_use"
    elif reason == "length":
        kind = "max_tokens" if len(out.token_ids) >= max_tokens else "model_context_window_exceeded"
    elif reason == "timeout":
        kind = "max_tokens"
    elif reason == "stop" and out.stop is not None:  # (the worker cut the text before it)
        kind, stop = "stop_sequence", out.stop
    else:
        kind = "end_turn"
    fields = {"stop_reason": kind, "stop_sequence": stop}
    if reason in ("timeout", "cancelled"):
        fields["mlxq_stop_reason"] = reason
    return fields


class BlockEvents:
    """A stream's deltas, in the shape ``ChatDeltas`` gives them (reasoning, answer, calls as their
    arguments grow), as Anthropic's content block events: one block open at a time, a new one each
    time the kind changes (a thought, text, each call).  Text that is only whitespace waits for more:
    the line between parallel calls is no answer (``chat_message``), and the stream says what the
    whole message says."""

    def __init__(self):
        self.index = -1
        self.open: Optional[tuple] = None  # ("thinking",) | ("text",) | ("tool_use", call index)
        self.blank = ""  # whitespace-only text not sent yet
        self.calls = 0

    def events(self, delta: dict) -> list[tuple[str, dict]]:
        out: list[tuple[str, dict]] = []
        if delta.get("reasoning_content"):
            out += self._to(("thinking",), {"type": "thinking", "thinking": "", "signature": ""})
            out.append(self._delta({"type": "thinking_delta", "thinking": delta["reasoning_content"]}))
        text = self.blank + (delta.get("content") or "")
        self.blank = text if not text.strip() else ""
        if text.strip():
            out += self._to(("text",), {"type": "text", "text": ""})
            out.append(self._delta({"type": "text_delta", "text": text}))
        for call in delta.get("tool_calls") or ():
            fn = call.get("function") or {}
            if "id" in call:  # a call's first entry: its id and name
                self.calls += 1
                self.blank = ""
                out += self._to(("tool_use", call["index"]), {"type": "tool_use", "id": call["id"],
                                                              "name": fn.get("name"), "input": {}})
            if fn.get("arguments"):  # (the call's block is open: nothing comes between its pieces)
                out.append(self._delta({"type": "input_json_delta", "partial_json": fn["arguments"]}))
        return out

    def close(self) -> list[tuple[str, dict]]:
        """The last block's end (and text held as blank, when no call came after it)."""
        out: list[tuple[str, dict]] = []
        if self.blank and not self.calls:
            out += self._to(("text",), {"type": "text", "text": ""})
            out.append(self._delta({"type": "text_delta", "text": self.blank}))
        if self.open is not None:
            out.append(("content_block_stop", {"type": "content_block_stop", "index": self.index}))
            self.open = None
        return out

    def _to(self, kind: tuple, start: Optional[dict]) -> list[tuple[str, dict]]:
        """The block ``kind`` open: the one open ended and ``start`` begun, unless it is open already."""
        if self.open == kind:
            return []
        out = []
        if self.open is not None:
            out.append(("content_block_stop", {"type": "content_block_stop", "index": self.index}))
        self.index += 1
        self.open = kind
        out.append(("content_block_start", {"type": "content_block_start", "index": self.index,
                                            "content_block": start}))
        return out

    def _delta(self, delta: dict) -> tuple[str, dict]:
        return "content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta}


def usage(res: Result) -> dict:
    """Anthropic's usage: ``input_tokens`` are the prompt's tokens not read from the prefix cache,
    ``cache_read_input_tokens`` those that were (Anthropic's split: the prompt is their sum)."""
    s = res.stats
    return {"input_tokens": s.prompt_tokens - s.cached_tokens, "output_tokens": s.generated_tokens,
            "cache_read_input_tokens": s.cached_tokens, "cache_creation_input_tokens": 0}
