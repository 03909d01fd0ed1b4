"""Tool calling and reasoning: a model's chat format, the tool-call grammar, request checks.

A model's :class:`ChatFormat` says how its chat template marks thinking and tool calls (the markers
mlx-lm infers when it loads the tokenizer, and the name of mlx-lm's tool parser for the family).  The
worker publishes it with the model's info, so a producer can refuse what the model cannot do before
anything is queued.

:func:`tool_grammar` is the llguidance grammar (Lark) of an answer under ``tools`` and
``tool_choice``, for the families whose call format it knows (:data:`CONSTRAINABLE`):

* ``"required"``: one call or more (exactly one when ``parallel_tool_calls`` is false), each naming one
  of the tools, its ``arguments`` valid for that tool's parameter schema;
* a named function: exactly one call of that function;
* ``"auto"``: free text; once the model starts a call (its start marker), the call is constrained as
  above, then free text, more calls (when parallel) or the end;
* ``"none"``: no grammar (tools are neither rendered nor parsed).

Where the format has thinking markers, an optional thinking block may come first and is free text: a
constraint applies to the answer, not to the thinking.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from typing import Any, Optional

# families whose tool-call format tool_grammar writes: mlx-lm's parser name -> call body layout
# json_tools (Hermes, Qwen2.5): <tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>
CONSTRAINABLE = ("json_tools",)
# JSON as the templates render it (json.dumps's separators), with no free whitespace to wander in
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
TEXT_RULE = r"/(.|\n)+/"  # free text: llguidance never lets a special token match a text lexeme
TAIL_RULE = r"/(.|\n)*/"


class ToolError(ValueError):
    """A request's tools or tool_choice cannot be served (before anything is queued: HTTP 400)."""


@dataclass(frozen=True)
class ChatFormat:
    """How a model's chat template marks thinking and tool calls (``None``: it does not).

    ``*_id`` is the marker's token id when the marker is one token (then grammars name the token
    itself, ``<[id]>``, so the model cannot spell the marker out of smaller pieces).
    """

    parser: Optional[str] = None  # mlx-lm's tool parser module for the family ("json_tools", ...)
    tool_call_start: Optional[str] = None
    tool_call_end: Optional[str] = None
    think_start: Optional[str] = None
    think_end: Optional[str] = None
    tool_call_start_id: Optional[int] = None
    tool_call_end_id: Optional[int] = None
    think_start_id: Optional[int] = None
    think_end_id: Optional[int] = None
    special_tool_markers: bool = False  # tool-call markers are special tokens (never plain text)

    @property
    def has_tools(self) -> bool:
        return bool(self.parser and self.tool_call_start)

    @property
    def has_thinking(self) -> bool:
        return bool(self.think_start and self.think_end)

    @property
    def can_constrain_tools(self) -> bool:
        """``tool_choice`` "required" and named functions can be enforced for this family."""
        return self.parser in CONSTRAINABLE and bool(self.tool_call_start and self.tool_call_end)

    def to_info(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v not in (None, False)}

    @classmethod
    def from_info(cls, info: Optional[dict]) -> "ChatFormat":
        """The format a worker published (``info["chat_format"]``); unknown keys are ignored."""
        raw = (info or {}).get("chat_format") if isinstance(info, dict) else None
        if not isinstance(raw, dict):
            return cls()
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in raw.items() if k in names})


# -- request checks ------------------------------------------------------------------------------

def effective_choice(req) -> Any:
    """``tool_choice`` as it applies: "none" without tools, "auto" by default with them."""
    if not req.tools:
        return "none"
    return req.tool_choice if req.tool_choice is not None else "auto"


def uses_tools(req) -> bool:
    """Tools are rendered into the prompt and calls are parsed from the output."""
    return effective_choice(req) != "none"


def forced_name(req) -> Optional[str]:
    choice = effective_choice(req)
    return None if isinstance(choice, str) else choice.function.get("name")


def check_tool_choice(tools, tool_choice) -> None:
    """Structure only (no schema compiler): a named or required choice needs tools, a named one must
    name one of them, and tool names are unique."""
    names = [t.function.name for t in tools or []]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ToolError(f"tools: duplicate function name(s) {', '.join(dupes)}")
    if tool_choice is None or tool_choice in ("none", "auto"):
        return
    if not names:
        raise ToolError(f"tool_choice {_choice_text(tool_choice)} needs tools")
    if not isinstance(tool_choice, str):
        name = tool_choice.function.get("name")
        if not name:
            raise ToolError('tool_choice: a named choice needs {"function": {"name": ...}}')
        if name not in names:
            raise ToolError(f"tool_choice names function {name!r}, which is not in tools "
                            f"(tools: {', '.join(names)})")


def _choice_text(choice) -> str:
    return repr(choice) if isinstance(choice, str) else repr(choice.function.get("name"))


def check_tools(req, fmt: Optional[ChatFormat] = None) -> None:
    """Everything about ``req``'s tools that can be known before queueing: the choice's structure,
    each parameter schema compiles (llguidance), and, when the model's format is known, that a
    required or named choice can be enforced for its family.  Raises :class:`ToolError`."""
    check_tool_choice(req.tools, req.tool_choice)
    if not uses_tools(req):
        return
    for tool in req.tools:
        _check_parameters(tool.function.name, tool.function.parameters)
    if fmt is not None:
        check_format(req, fmt)


def check_format(req, fmt: ChatFormat) -> None:
    """A required or named tool choice on a model whose call format cannot be enforced: refused."""
    choice = effective_choice(req)
    if choice in ("none", "auto"):
        return
    if not fmt.has_tools:
        raise ToolError(f"tool_choice {_choice_text(choice)}: this model's chat template has no tool-call "
                        "format mlx-lm knows, so calls can be neither enforced nor parsed")
    if not fmt.can_constrain_tools:
        raise ToolError(f"tool_choice {_choice_text(choice)} cannot be enforced for this model's tool-call "
                        f"format ({fmt.parser!r}; enforced: {', '.join(CONSTRAINABLE)}); use tool_choice "
                        '"auto" (calls are still parsed)')


def parameters_schema(parameters: Optional[dict]) -> dict:
    """A tool's parameter schema as the grammar uses it (none given: any JSON object)."""
    return dict(parameters) if parameters else {"type": "object"}


def _check_parameters(name: str, parameters: Optional[dict]) -> None:
    schema = parameters_schema(parameters)
    if schema.get("type", "object") != "object":
        raise ToolError(f"tools: function {name!r}: parameters must be a JSON schema of an object "
                        f"(got type {schema.get('type')!r})")
    from llguidance import LLMatcher

    try:
        grammar = LLMatcher.grammar_from_json_schema(_styled(schema))
    except (ValueError, TypeError) as exc:
        raise ToolError(f"tools: function {name!r}: parameters are not a JSON schema: {exc}") from None
    err = LLMatcher.validate_grammar(grammar)
    if err:
        raise ToolError(f"tools: function {name!r}: parameter schema not supported: {_first_line(err)}")


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else text


def _styled(schema: dict) -> dict:
    """``schema`` with the JSON layout the templates render (the caller's own x-guidance wins)."""
    return {**schema, "x-guidance": {**JSON_STYLE, **(schema.get("x-guidance") or {})}}


# -- the grammar ---------------------------------------------------------------------------------

def tool_grammar(req, fmt: ChatFormat, *, answer: Optional[str] = None, in_thinking: bool = False) -> Optional[str]:
    """The Lark grammar (llguidance) of ``req``'s answer under its tools, or None when tools do not
    constrain it (no tools, ``tool_choice`` "none", or "auto" on a family whose calls cannot be
    constrained: those are parsed only).

    ``answer``: a Lark expression for a text answer other than free text (a response_format's
    grammar, e.g. ``%json {...}``), used by "auto" in place of free text.  ``in_thinking``: the prompt
    ends inside an open thinking block (the template opened it), so the output starts as thinking.
    Raises :class:`ToolError` for a choice the format cannot enforce."""
    choice = effective_choice(req)
    if choice == "none":
        return None
    if not fmt.can_constrain_tools:
        check_format(req, fmt)  # required/named: refused; auto: parsed only
        return None
    tools = {t.function.name: t.function.parameters for t in req.tools}
    named = forced_name(req)
    if named is not None:
        tools = {named: tools[named]}
    many = req.parallel_tool_calls and named is None
    rules = [f'call_body: "\\n" ({" | ".join(f"tool_{i}" for i in range(len(tools)))}) "\\n" '
             + _marker(fmt.tool_call_end, fmt.tool_call_end_id)]
    rules += [_tool_rule(i, name, params) for i, (name, params) in enumerate(tools.items())]
    if choice == "auto" and answer is None:
        body = _free_text_with_calls(fmt, many, rules)
    else:
        rules.append("call: " + _marker(fmt.tool_call_start, fmt.tool_call_start_id) + " call_body")
        calls = 'call ("\\n" call)*' if many else "call"
        if choice == "auto":  # a structured answer, or calls
            rules.append(f"answer: {answer}")
            calls = f"answer | {calls}"
        body = calls
    return _with_thinking(body, fmt, in_thinking, rules)


def _free_text_with_calls(fmt: ChatFormat, many: bool, rules: list[str]) -> str:
    """``tool_choice`` "auto": free text, and a call wherever the model starts one."""
    if fmt.tool_call_start_id is not None and fmt.special_tool_markers:
        # the start marker is a special token, which free text never matches
        rules += [f"call: <[{fmt.tool_call_start_id}]> call_body", f"TEXT: {TEXT_RULE}"]
        return "TEXT? (call TEXT?)*" if many else "TEXT? (call TEXT?)?"
    # a marker that plain text can spell: a call starts where the text first holds it (a lazy lexeme)
    rules += [f"call_open[lazy]: TAIL {json.dumps(fmt.tool_call_start)}", "call: call_open call_body",
              f"TAIL: {TAIL_RULE}"]
    return "call* TAIL" if many else "call? TAIL"


def _tool_rule(i: int, name: str, parameters: Optional[dict]) -> str:
    head = json.dumps('{"name": ' + json.dumps(name) + ', "arguments": ')
    return f'tool_{i}: {head} %json {json.dumps(_styled(parameters_schema(parameters)))} "}}"'


def _marker(text: Optional[str], token_id: Optional[int]) -> str:
    return f"<[{token_id}]>" if token_id is not None else json.dumps(text)


def _with_thinking(body: str, fmt: ChatFormat, in_thinking: bool, rules: list[str]) -> str:
    """The whole grammar: an optional (or already open) free thinking block, then ``body``."""
    head = "start: " + body
    if fmt.has_thinking:
        end = _marker(fmt.think_end, fmt.think_end_id)
        if in_thinking:
            head = f"start: THOUGHT? {end} GAP? answer_body"
        else:
            head = "start: think? answer_body"
            rules.append(f"think: {_marker(fmt.think_start, fmt.think_start_id)} THOUGHT? {end} GAP?")
        rules += [f"answer_body: {body}", f"THOUGHT: {TEXT_RULE}", r"GAP: /[ \t\n]+/"]
    return "%llguidance {}\n" + head + "\n" + "\n".join(rules) + "\n"
