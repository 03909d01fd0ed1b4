"""Tool calling and reasoning: a model's chat format, the tool-call grammar, request checks.

A model's format (:class:`mlxq.shared.constraints.ModelFormat`) says how its chat template marks
thinking and tool calls: the markers mlx-lm infers when it loads the tokenizer, and the name of
mlx-lm's tool parser for the family.  The worker publishes it with the model's info
(:func:`format_info`), so a producer can refuse what the model cannot do before anything is queued.

A chat template with no tool slot (it renders no ``tools``; ChatML as SmolLM2's, Gemma's, Phi's), one
whose calls mlx-lm cannot parse, and a model with no template at all take tools through mlxq's own
call format (:func:`own_format`, ``mlxq_tools``): the worker describes the tools to the model itself
(``mlxq.worker.toolprompt``) and the grammar holds it to Hermes's format, the markers plain text::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

:func:`tool_grammar` is the llguidance grammar (Lark) of an answer under ``tools`` and
``tool_choice``, for the families whose call format it knows (:data:`CONSTRAINABLE`):

* ``"required"``: one call or more (exactly one when ``parallel_tool_calls`` is false), each naming one
  of the tools, its ``arguments`` valid for that tool's parameter schema;
* a named function: exactly one call of that function;
* ``"auto"``: free text; once the model starts a call (its start marker), the call is constrained as
  above, then more calls (when parallel) or the end (a marker that is text: text may follow, never
  holding the marker when ``parallel_tool_calls`` is false);
* ``"none"``: no grammar (tools are neither rendered nor parsed).

Where the format has thinking markers, an optional thinking block may come first and is free text: a
constraint applies to the answer, not to the thinking (``constraints.after_thinking``); a thought
never holds a call (a start marker that is text is kept out of it).  With "auto"
and a ``response_format``, the answer is either that format or calls.
"""

from __future__ import annotations

import functools
import json
from dataclasses import asdict, fields, replace
from typing import Any, Optional

from .constraints import (ANY_TEXT, ConstraintError, ModelFormat, after_thinking, canonical, closed, compile_format,
                          grammar_list, marker_item, special_marker, without_text)

# families whose tool-call format tool_grammar writes (mlx-lm's parser names); json_tools (Hermes,
# Qwen2.5): <tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>
CONSTRAINABLE = ("json_tools",)
# mlxq's own call format, for a model whose template has none: Hermes's (json_tools), which the grammar
# writes and mlx-lm's json_tools parser reads; the markers are plain text (whatever tokens spell them)
OWN_CALL_START, OWN_CALL_END, OWN_PARSER = "<tool_call>", "</tool_call>", "json_tools"
# arguments as chat templates render them (json.dumps's separators), with no free whitespace
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
TEXT_RULE = r"/(.|\n)+/"  # free text: llguidance never lets a special token match a text lexeme
CALLS = 'call ("\\n"? call)*'  # parallel calls, one after another or a line apart


class ToolError(ConstraintError):
    """A request's tools or tool_choice cannot be served (before anything is queued: HTTP 400)."""


# -- the model's format --------------------------------------------------------------------------

def can_constrain(fmt: ModelFormat) -> bool:
    """``tool_choice`` "required" and named functions can be enforced for this model's family."""
    return fmt.tool_parser in CONSTRAINABLE and bool(fmt.tool_call_start and fmt.tool_call_end)


def own_format(fmt: ModelFormat, tokenizer) -> ModelFormat:
    """``fmt`` (the reasoning markers kept) with mlxq's own call format in place of the template's:
    the markers' token ids as ``tokenizer`` (an mlx-lm ``TokenizerWrapper`` or a Hugging Face
    tokenizer) spells them; a marker that happens to be one added token stays that token."""
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    start, end = (tuple(hf.encode(m, add_special_tokens=False)) for m in (OWN_CALL_START, OWN_CALL_END))
    return replace(fmt, tool_call_start=OWN_CALL_START, tool_call_end=OWN_CALL_END, tool_parser=OWN_PARSER,
                   tool_call_start_ids=start, tool_call_end_ids=end,
                   tool_markers_special=special_marker(tokenizer, start), mlxq_tools=True)


def format_info(fmt: ModelFormat) -> dict:
    """What a worker publishes of its model's format (``info["chat_format"]``)."""
    return {k: v for k, v in asdict(fmt).items() if k != "in_thinking" and v not in (None, False, ())}


def format_from_info(info: Optional[dict]) -> Optional[ModelFormat]:
    """The format a worker published; None when it published none (an older worker)."""
    raw = info.get("chat_format") if isinstance(info, dict) else None
    if not isinstance(raw, dict):
        return None
    kinds = {f.name: f for f in fields(ModelFormat)}
    out = {k: tuple(v) if isinstance(v, list) else v for k, v in raw.items() if k in kinds}
    return replace(ModelFormat(), **out)


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


def check_tools(req, fmt: Optional[ModelFormat] = None) -> None:
    """Everything about ``req``'s tools that can be known before queueing: the choice's structure,
    each parameter schema compiles (llguidance), and, when the model's format is known, that a
    required or named choice can be enforced for its family.  Raises :class:`ToolError`."""
    check_tool_choice(req.tools, req.tool_choice)
    if not uses_tools(req):
        return
    for tool in req.tools:
        error = _parameters_error(canonical(tool_schema(tool.function)))
        if error:
            raise ToolError(f"tools: function {tool.function.name!r}: {error}")
    if fmt is not None:
        check_format(req, fmt)


def check_format(req, fmt: ModelFormat) -> None:
    """What a model whose call format cannot be enforced cannot do, refused: a required or named tool
    choice; with "auto", an answer held to a response_format, or parallel_tool_calls false. A model
    whose template has no call format mlx-lm knows cannot take tools at all: its calls could not be
    parsed, and would come back as text in the answer."""
    choice = effective_choice(req)
    if choice == "none" or can_constrain(fmt):
        return
    if not fmt.tool_parser:
        raise ToolError(f"tools with tool_choice {_choice_text(choice)}: this model's chat template has no "
                        "tool-call format mlx-lm knows, so its calls could be neither enforced nor parsed (they "
                        'would come back as text); send no tools, or tool_choice "none"')
    if choice == "auto":
        why = ("response_format" if compile_format(req.response_format) is not None else
               "parallel_tool_calls false" if req.parallel_tool_calls is False else None)
        if why is not None:
            raise ToolError(f"{why} with tools cannot be enforced for this model's tool-call format "
                            f"({fmt.tool_parser!r}; enforced: {', '.join(CONSTRAINABLE)}): "
                            "the calls are parsed only, so nothing would hold the answer to it")
        return
    if not can_constrain(fmt):
        raise ToolError(f"tool_choice {_choice_text(choice)} cannot be enforced for this model's tool-call "
                        f"format ({fmt.tool_parser!r}; enforced: {', '.join(CONSTRAINABLE)}); use tool_choice "
                        '"auto" (calls are still parsed)')


def parameters_schema(parameters: Optional[dict]) -> dict:
    """A tool's parameter schema as the grammar uses it (none given: any JSON object)."""
    return dict(parameters) if parameters else {"type": "object"}


def tool_schema(function) -> dict:
    """The schema a tool's arguments are held to: its parameters, closed (every object
    ``additionalProperties: false`` unless it says otherwise) unless ``function.strict`` is false.

    Closed by default, as vLLM's grammar backend holds tool arguments: a call's arguments are what a
    library parses into its own class, and a small model shown the schema in its prompt goes on
    writing schema keywords as keys until max_tokens cuts the call (LangChain's function_calling
    structured output on SmolLM2 did).  ``strict: false`` keeps the schema as written, open objects
    and all."""
    schema = parameters_schema(function.parameters)
    return schema if function.strict is False else closed(schema)


@functools.lru_cache(maxsize=512)
def _parameters_error(schema_json: str) -> Optional[str]:
    """Why a parameter schema (canonical JSON) cannot constrain arguments, or None."""
    from llguidance import LLMatcher

    schema = json.loads(schema_json)
    if not isinstance(schema, dict) or schema.get("type", "object") != "object":
        got = schema.get("type") if isinstance(schema, dict) else type(schema).__name__
        return f"parameters must be a JSON schema of an object (got type {got!r})"
    try:
        grammar = LLMatcher.grammar_from_json_schema(_styled(schema))
    except (ValueError, TypeError) as exc:
        return f"parameters are not a JSON schema: {_first_line(str(exc))}"
    err = LLMatcher.validate_grammar(grammar)
    return f"parameter schema not supported: {_first_line(err)}" if err else None


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else text


def _styled(schema: dict) -> dict:
    """``schema`` with the JSON layout the templates render (the caller's own x-guidance wins)."""
    return {**schema, "x-guidance": {**JSON_STYLE, **(schema.get("x-guidance") or {})}}


# -- the grammar ---------------------------------------------------------------------------------

def tool_grammar(req, fmt: ModelFormat) -> Optional[str]:
    """The llguidance grammar (its JSON form) of ``req``'s answer under its tools, or None when tools
    do not constrain it: no tools, ``tool_choice`` "none", or "auto" on a family whose calls cannot
    be constrained (they are parsed only).  Raises :class:`ToolError` for a required or named choice
    the format cannot enforce.  ``fmt.in_thinking``: the prompt ends inside an open thinking block."""
    choice = effective_choice(req)
    if choice == "none":
        return None
    if not can_constrain(fmt):
        check_format(req, fmt)  # required/named: refused; auto: parsed only
        return None
    tools = {t.function.name: tool_schema(t.function) for t in req.tools}
    named = forced_name(req)
    if named is not None:
        tools = {named: tools[named]}
    many = req.parallel_tool_calls and named is None
    end = marker_item(fmt.tool_call_end, fmt.tool_call_end_ids)
    rules = [f'call_body: "\\n" ({" | ".join(f"tool_{i}" for i in range(len(tools)))}) "\\n" {end}']
    rules += [_tool_rule(i, name, params) for i, (name, params) in enumerate(tools.items())]
    answer = compile_format(req.response_format) if choice == "auto" else None
    if choice == "auto" and answer is None:
        body = _free_text_with_calls(fmt, many, rules)
    else:
        rules.append(f"call: {marker_item(fmt.tool_call_start, fmt.tool_call_start_ids)} call_body")
        body = CALLS if many else "call"
        if answer is not None:  # the response_format's answer, or calls
            body = f"@format | {body}"
    lark = "%llguidance {}\nstart: " + body + "\n" + "\n".join(rules) + "\n"
    grammars = [{"name": "tools", "lark_grammar": lark}]
    if answer is not None:
        sub = grammar_list(answer)
        grammars += [dict(sub[0], name="format")] + sub[1:]
    grammar = json.dumps({"grammars": grammars})
    if not fmt.think_start:
        return grammar
    return after_thinking(grammar, fmt, never=None if _start_is_token(fmt) else fmt.tool_call_start)


def _start_is_token(fmt: ModelFormat) -> bool:
    """The call's start marker is one special token, which free text never matches."""
    return len(fmt.tool_call_start_ids) == 1 and fmt.tool_markers_special


def _free_text_with_calls(fmt: ModelFormat, many: bool, rules: list[str]) -> str:
    """``tool_choice`` "auto": free text, and a call wherever the model starts one."""
    if _start_is_token(fmt):
        # the start marker is a special token, which free text never matches; after a call, only
        # more calls (when parallel) or the end
        rules += [f"call: <[{fmt.tool_call_start_ids[0]}]> call_body", f"TEXT: {TEXT_RULE}"]
        return f"TEXT? ({CALLS})?" if many else "TEXT? call?"
    # a marker that plain text can spell: a call starts where the text first holds it (a lazy lexeme,
    # as llguidance's StructTag writes it); text may follow the calls.  One call at most: the text
    # after it never holds the marker (it would be a second call, unconstrained and parsed all the same)
    rules += [f"call_open[lazy]: TAIL {json.dumps(fmt.tool_call_start)}", "call: call_open call_body",
              f"TAIL: {ANY_TEXT}"]
    if many:
        return "call* TAIL"
    rules.append(f"REST: {without_text(fmt.tool_call_start)}")
    return "call REST | TAIL"


def _tool_rule(i: int, name: str, schema: dict) -> str:
    head = json.dumps('{"name": ' + json.dumps(name) + ', "arguments": ')
    return f'tool_{i}: {head} %json {json.dumps(_styled(schema))} "}}"'

