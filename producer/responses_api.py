"""OpenAI's Responses API shapes, mapped to and from mlxq's (no I/O: the gateway's room is
``gateway/responses.py``).

A response is one queue job: its id is ``resp_`` + the job's id.  The request becomes the job's chat
``messages`` (``instructions`` first, as a system message), ``text.format`` its ``response_format``
and function ``tools`` / ``tool_choice`` its tools, so the constraint machinery of Chat Completions
enforces them.  ``ResponseEvents`` turns the job's deltas into the API's stream events; it is a
function of the deltas alone, so every gateway numbers a replay's events (``sequence_number``) as
the live stream's, after a restart or the compaction of the finished job's record too.
"""

from __future__ import annotations

import time
from typing import Any, Optional, Union

from pydantic import Field, StrictInt, StrictStr

from ..shared.schemas import JOB_ID, Delta, Result
from .openai_api import ChatDeltas, OpenAIError, _Params, chat_message, unsupported

RESP_PREFIX = "resp_"
# tools OpenAI runs on its side: refused by name (mlxq runs no tool, it only writes calls of yours)
BUILT_IN_TOOLS = frozenset({
    "web_search", "web_search_preview", "web_search_2025_08_26", "web_search_preview_2025_03_11", "file_search",
    "computer", "computer_use", "computer_use_preview", "code_interpreter", "image_generation", "mcp",
    "local_shell", "shell", "apply_patch", "custom", "tool_search"})
# include= values that change nothing mlxq returns; any other is refused by name
HARMLESS_INCLUDES = frozenset({"reasoning.encrypted_content"})


def response_id(job_id: str) -> str:
    return RESP_PREFIX + job_id


def job_id_of(resp_id: str) -> Optional[str]:
    """The job id a response id names, or None when it is not one of ours."""
    job = resp_id.removeprefix(RESP_PREFIX)
    return job if resp_id.startswith(RESP_PREFIX) and JOB_ID.fullmatch(job) else None


class ResponsesRequest(_Params):
    """``POST /v1/responses``; the sampling extensions of Chat Completions (top_k, logit_bias,
    ignore_eos, ...) are accepted as they are there."""

    STREAM_OPTIONS = ("include_obfuscation",)  # mlxq sends no obfuscation: accepted, nothing to do
    input: Union[StrictStr, list[dict]]
    instructions: Optional[StrictStr] = None
    max_output_tokens: Optional[StrictInt] = Field(None, ge=1)
    text: Optional[dict[str, Any]] = None
    tools: Optional[list[dict]] = None
    tool_choice: Optional[Union[StrictStr, dict]] = None
    parallel_tool_calls: Optional[bool] = None
    background: Optional[bool] = None
    store: Optional[bool] = None
    previous_response_id: Optional[StrictStr] = None
    metadata: Optional[dict[str, StrictStr]] = None
    include: Optional[list[StrictStr]] = None
    reasoning: Optional[dict[str, Any]] = None
    truncation: Optional[StrictStr] = None

    def check(self) -> None:
        """What the Responses API has and mlxq cannot honour: a 400 naming it."""
        self.check_common()
        for name, instead in (("max_tokens", "max_output_tokens"), ("response_format", "text.format"),
                              ("n", None)):
            if getattr(self, name) is not None:
                raise unsupported(name, f"the Responses API's is {instead}" if instead else "one output per response")
        if self.background and self.store is False:
            raise OpenAIError(400, "background responses need store: true (a background response is kept to be "
                                   "polled)", param="background", code="invalid_value")
        if self.truncation not in (None, "disabled"):
            raise unsupported("truncation", "an input longer than the context is refused, never cut")
        for name in self.include or ():
            if name not in HARMLESS_INCLUDES:
                raise unsupported(f"include.{name}")
        if any(v is not None for v in (self.reasoning or {}).values()):
            raise unsupported("reasoning", "a model that thinks does so by its chat template; its thought comes "
                                           "back as a reasoning item")
        for name, value in (self.text or {}).items():
            if name != "format" and value is not None:
                raise unsupported(f"text.{name}")

    @property
    def kept(self) -> bool:
        """Whether the response is stored (OpenAI's default: yes)."""
        return self.store is not False

    def submit_kwargs(self, history: Optional[list[dict]] = None) -> dict[str, Any]:
        """``AsyncClient.submit``'s arguments; ``history``: the earlier turns (``previous_response_id``)."""
        self.check()
        kw = self.sampling()
        if self.max_output_tokens is not None:
            kw["max_tokens"] = self.max_output_tokens
        fmt = text_format(self.text)
        if fmt is not None:
            kw["response_format"] = fmt
        if self.tools:
            kw["tools"] = [function_tool(t, i) for i, t in enumerate(self.tools)]
        if self.tool_choice is not None:
            kw["tool_choice"] = tool_choice(self.tool_choice)
        if self.parallel_tool_calls is not None:
            kw["parallel_tool_calls"] = self.parallel_tool_calls
        messages = [{"role": "system", "content": self.instructions}] if self.instructions is not None else []
        messages += history or []
        messages += input_messages(self.input, messages)
        if not any(m["role"] != "system" for m in messages):
            raise OpenAIError(400, "input: the conversation has no message to answer", param="input",
                              code="invalid_value")
        kw["messages"] = messages
        return kw

    def shell(self, model: str, created_at: float) -> dict[str, Any]:
        """The response object's fields that echo the request: kept with the job (the record's
        ``resp`` field) for a poll, a replay and a follow-up to read."""
        return {"created_at": created_at, "model": model, "instructions": self.instructions,
                "max_output_tokens": self.max_output_tokens, "metadata": self.metadata or {},
                "parallel_tool_calls": self.parallel_tool_calls is not False,
                "previous_response_id": self.previous_response_id, "temperature": self.temperature,
                "top_p": self.top_p, "text": {"format": (self.text or {}).get("format") or {"type": "text"}},
                "tool_choice": self.tool_choice or "auto", "tools": self.tools or [], "truncation": "disabled",
                "background": bool(self.background), "store": self.kept}


def text_format(text: Optional[dict]) -> Optional[dict]:
    """``text.format`` as mlxq's ``response_format`` (Chat Completions' shape), None for plain text."""
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise OpenAIError(400, "text.format must be an object", param="text.format", code="invalid_value")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise OpenAIError(400, "text.format.schema: a JSON schema (an object) is required", param="text.format",
                              code="invalid_value")
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if fmt.get(k) is not None}
        return {"type": "json_schema", "json_schema": spec}
    raise unsupported(f"text.format.type {kind!r}", "text, json_object and json_schema are")


def function_tool(tool: dict, i: int) -> dict:
    """A Responses function tool (flat: ``{"type", "name", "parameters", ...}``) in Chat Completions'
    shape; a built-in tool is refused by name."""
    kind = tool.get("type")
    if kind in BUILT_IN_TOOLS:
        raise OpenAIError(400, f"the built-in tool {kind!r} is not supported (tools.{i}): mlxq runs no tool, it "
                               "writes calls of your function tools", param=f"tools.{i}", code="unsupported_value")
    if kind != "function":
        raise unsupported(f"tools.{i}.type {kind!r}", "only function tools are")
    extra = sorted(set(tool) - {"type", "name", "description", "parameters", "strict"})
    if extra:
        raise unsupported(f"tools.{i}.{extra[0]}")
    fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
    return {"type": "function", "function": fn}


def tool_choice(choice: Union[str, dict]) -> Union[str, dict]:
    if isinstance(choice, str):
        return choice  # none | auto | required (the job's validation names anything else)
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise unsupported(f"tool_choice type {choice.get('type')!r}", "a function by name, none, auto and required are")


def input_messages(items: Union[str, list[dict]], before: list[dict]) -> list[dict]:
    """``input`` as mlxq chat messages: messages, a call (``function_call``, into the assistant
    message before it, as Chat Completions carries calls) and its output (a tool message);
    reasoning items are dropped, as Chat Completions drops an assistant's reasoning."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict] = []
    names = {c["id"]: c["function"]["name"] for m in before for c in m.get("tool_calls") or ()}
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise OpenAIError(400, f"input.{i}.role: {role!r} is not a role (user, system, developer, assistant)",
                                  param=f"input.{i}.role", code="invalid_value")
            out.append({"role": "system" if role == "developer" else role, "content": _text(item.get("content"), i)})
        elif kind == "function_call":
            call = {"id": _str(item, "call_id", i), "type": "function",
                    "function": {"name": _str(item, "name", i), "arguments": _str(item, "arguments", i)}}
            names[call["id"]] = call["function"]["name"]
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id = _str(item, "call_id", i)
            msg = {"role": "tool", "tool_call_id": call_id, "content": _text(item.get("output"), i, "output")}
            if call_id in names:
                msg["name"] = names[call_id]
            out.append(msg)
        elif kind != "reasoning":
            raise unsupported(f"input.{i}.type {kind!r}", "messages, function_call and function_call_output items are")
    return out


def _str(item: dict, name: str, i: int) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise OpenAIError(400, f"input.{i}.{name}: a string is required", param=f"input.{i}.{name}",
                          code="invalid_value")
    return value


def _text(content, i: int, name: str = "content") -> str:
    """A message's content (a string or text parts) as one string."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise OpenAIError(400, f"input.{i}.{name}: a string or a list of text parts is required",
                          param=f"input.{i}.{name}", code="invalid_value")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "refusal":
            continue
        if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise OpenAIError(400, f"input.{i}.{name}.{j}: only text parts are supported (not {kind!r})",
                              param=f"input.{i}.{name}.{j}", code="unsupported_value")
        parts.append(part["text"])
    return "".join(parts)


def previous_turns(req: dict, res: Result, had_instructions: bool) -> list[dict]:
    """The conversation a follow-up to a response goes on from: its job's messages (without its
    ``instructions``, which OpenAI does not carry over) and its answer."""
    messages = list(req.get("messages") or [])[1 if had_instructions else 0:]
    answer = chat_message(res)
    msg = {"role": "assistant", "content": answer["content"] or ""}
    if answer.get("tool_calls"):
        msg["tool_calls"] = [{"id": c["id"], "type": "function", "function": c["function"]}
                             for c in answer["tool_calls"]]
    return messages + [msg]


# -- the response object ---------------------------------------------------------------------------

STATUS_OF_FINISH = {"stop": "completed", "tool_calls": "completed", "length": "incomplete",
                    "timeout": "incomplete", "cancelled": "cancelled", "error": "failed"}


def status_of(job_status: Optional[str], res: Optional[Result]) -> str:
    """The response's status: queued, in_progress, or the finished job's."""
    if res is not None:
        return STATUS_OF_FINISH[res.finish_reason]
    return "queued" if job_status == "queued" else "in_progress"


def response_object(resp_id: str, shell: dict, status: str, output: Optional[list] = None,
                    res: Optional[Result] = None, reasoning_tokens: int = 0) -> dict:
    """The API's response object: the request's echo (``shell``), the status, the output and usage."""
    obj = {"id": resp_id, "object": "response", **shell, "status": status, "output": output or [], "error": None,
           "incomplete_details": None, "usage": None, "completed_at": None}
    if res is None:
        return obj
    obj["usage"] = usage(res, reasoning_tokens)
    if res.stats.finished_at is not None:
        obj["completed_at"] = res.stats.finished_at
    if status == "failed":
        obj["error"] = {"code": "server_error", "message": res.error or "generation failed"}
    elif status == "incomplete":
        # OpenAI's reason is max_output_tokens; a job past its timeout_s says so in mlxq's own word
        obj["incomplete_details"] = {"reason": "max_output_tokens" if res.finish_reason == "length" else "timeout"}
    return obj


def usage(res: Result, reasoning_tokens: int = 0) -> dict:
    u = res.usage
    return {"input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": u.cached_tokens},
            "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": u.total_tokens}


def item_status(status: str) -> str:
    """An output item's status in a response of ``status``."""
    return "completed" if status == "completed" else "incomplete"


def output_items(job_id: str, res: Result, status: str) -> list[dict]:
    """A finished job's output items (``status``: the response's): its reasoning, its answer (none
    when it only made calls), its calls: the items ``ResponseEvents`` streams, in the same order and
    with the same ids."""
    status = item_status(status)
    items = []
    if res.reasoning:
        items.append(reasoning_item(job_id, res.reasoning, status))
    msg = chat_message(res)
    if msg["content"] is not None:
        items.append(message_item(job_id, msg["content"], status))
    items += [call_item(job_id, k, c.id, c.function.get("name", ""), c.function.get("arguments", ""), status)
              for k, c in enumerate(res.tool_calls or ())]
    return items


def reasoning_item(job_id: str, text: str, status: str) -> dict:
    return {"type": "reasoning", "id": f"rs_{job_id}", "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}


def message_item(job_id: str, text: Optional[str], status: str) -> dict:
    content = [] if text is None else [output_text(text)]
    return {"type": "message", "id": f"msg_{job_id}", "role": "assistant", "status": status, "content": content}


def output_text(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(job_id: str, k: int, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {"type": "function_call", "id": f"fc_{job_id}_{k}", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def now() -> float:
    return round(time.time(), 3)


# -- the stream's events ---------------------------------------------------------------------------

class ResponseEvents:
    """One response's stream events, from its job's deltas, numbered from 0 (``sequence_number``).

    The items open as the job writes them: its reasoning, then its answer (a message), then its
    calls; each closes (its ``.done`` events) when the next kind begins or the job ends.  Where the
    job may make calls, whitespace before any answer is held back, and dropped when calls follow
    (as ``output_items`` drops a call-only answer's whitespace).  Everything here follows from the
    deltas in order, so a replay of the same job numbers its events as the live stream did."""

    def __init__(self, resp_id: str, job_id: str, tools: bool):
        self.resp_id, self.job_id, self.tools = resp_id, job_id, tools
        self.seq = 0
        self.chat = ChatDeltas()
        self.items: list[dict] = []  # output items in order, as streamed so far
        self.open: list[int] = []  # output indexes of items not closed yet
        self.reasoning: Optional[int] = None  # the reasoning item's output index
        self.message: Optional[int] = None  # the answer's
        self.calls: dict[int, int] = {}  # the job's call number -> its item's output index
        self.held = ""  # whitespace not sent yet (see the class's docstring)

    def _event(self, kind: str, **fields) -> dict:
        ev = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return ev

    def start(self, response: dict) -> list[dict]:
        """``response.created`` and ``response.in_progress`` (``response``: the object as it starts)."""
        return [self._event("response.created", response=response),
                self._event("response.in_progress", response={**response, "status": "in_progress"})]

    def feed(self, d: Delta) -> list[dict]:
        """The events of one delta of the job's output."""
        delta = self.chat.delta(d)
        out: list[dict] = []
        if delta.get("reasoning_content"):
            out += self._reasoning(delta["reasoning_content"])
        if delta.get("content"):
            out += self._text(delta["content"])
        for call in delta.get("tool_calls") or ():
            out += self._call(call)
        return out

    def finish(self, response: dict) -> list[dict]:
        """Close what is open, then the response's last event (``response``: the object as it ended)."""
        out: list[dict] = []
        if self.message is None and not self.calls:  # an answer of whitespace only, or none: as output_items
            out += self._text(self.held, force=True)
        status = item_status(response["status"])
        for k in list(self.open):
            out += self._close(k, status)
        kind = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(
            response["status"], "response.failed")  # failed, and cancelled (the API has no event of its own)
        out.append(self._event(kind, response=response))
        return out

    # -- items -----------------------------------------------------------------------------------
    def _add(self, item: dict) -> tuple[int, dict]:
        k = len(self.items)
        self.items.append(item)
        self.open.append(k)
        return k, self._event("response.output_item.added", output_index=k, item=_in_progress(item))

    def _reasoning(self, piece: str) -> list[dict]:
        out = []
        if self.reasoning is None:
            self.reasoning, added = self._add(reasoning_item(self.job_id, "", "in_progress"))
            out += [added, self._event("response.content_part.added", item_id=f"rs_{self.job_id}",
                                       output_index=self.reasoning, content_index=0,
                                       part={"type": "reasoning_text", "text": ""})]
        self.items[self.reasoning]["content"][0]["text"] += piece
        out.append(self._event("response.reasoning_text.delta", item_id=f"rs_{self.job_id}",
                               output_index=self.reasoning, content_index=0, delta=piece))
        return out

    def _text(self, piece: str, force: bool = False) -> list[dict]:
        if self.message is None and self.tools and not force and not (self.held + piece).strip():
            self.held += piece  # whitespace before any answer: held until text or the end says which
            return []
        piece, self.held = self.held + piece, ""
        out = self._close_reasoning()
        if self.message is None:
            self.message, added = self._add(message_item(self.job_id, "", "in_progress"))
            out += [added, self._event("response.content_part.added", item_id=f"msg_{self.job_id}",
                                       output_index=self.message, content_index=0,
                                       part=output_text(""))]
        if piece:
            self.items[self.message]["content"][0]["text"] += piece
            out.append(self._event("response.output_text.delta", item_id=f"msg_{self.job_id}",
                                   output_index=self.message, content_index=0, delta=piece, logprobs=[]))
        return out

    def _call(self, entry: dict) -> list[dict]:
        """A call's entry as ``ChatDeltas`` gives it: its first names it (id, name), the next ones
        carry more of its arguments."""
        out = self._close_reasoning()
        k, fn = entry["index"], entry.get("function") or {}
        if k not in self.calls:
            if self.message is not None and self.message in self.open:
                out += self._close(self.message, "completed")
            self.calls[k], added = self._add(call_item(self.job_id, k, entry.get("id") or "", fn.get("name") or "",
                                                       "", "in_progress"))
            out.append(added)
        i = self.calls[k]
        piece = fn.get("arguments") or ""
        if piece:
            self.items[i]["arguments"] += piece
            out.append(self._event("response.function_call_arguments.delta", item_id=self.items[i]["id"],
                                   output_index=i, delta=piece))
        return out

    def _close_reasoning(self) -> list[dict]:
        if self.reasoning is not None and self.reasoning in self.open:
            return self._close(self.reasoning, "completed")
        return []

    def _close(self, k: int, status: str) -> list[dict]:
        self.open.remove(k)
        item = self.items[k]
        item["status"] = status
        out = []
        if item["type"] == "reasoning":
            text = item["content"][0]["text"]
            out += [self._event("response.reasoning_text.done", item_id=item["id"], output_index=k, content_index=0,
                                text=text),
                    self._event("response.content_part.done", item_id=item["id"], output_index=k, content_index=0,
                                part={"type": "reasoning_text", "text": text})]
        elif item["type"] == "message":
            part = item["content"][0]
            out += [self._event("response.output_text.done", item_id=item["id"], output_index=k, content_index=0,
                                text=part["text"], logprobs=[]),
                    self._event("response.content_part.done", item_id=item["id"], output_index=k, content_index=0,
                                part=dict(part))]
        else:
            out.append(self._event("response.function_call_arguments.done", item_id=item["id"], output_index=k,
                                   name=item["name"], arguments=item["arguments"]))
        out.append(self._event("response.output_item.done", output_index=k, item=_copy(item)))
        return out


def _in_progress(item: dict) -> dict:
    """An item as ``output_item.added`` shows it: empty, in progress."""
    out = _copy(item)
    if out["type"] == "message":
        out["content"] = []
    elif out["type"] == "reasoning":
        out["content"] = []
    return out


def _copy(item: dict) -> dict:
    out = dict(item)
    if "content" in out:
        out["content"] = [dict(p) for p in out["content"]]
    return out
