"""Tools for a chat model whose template has no tool slot: mlxq describes them to the model itself.

A template renders ``tools`` when it has a slot for them (Hermes, Qwen2.5, Llama 3.1, ...); many do
not (SmolLM2's ChatML, Gemma's, Phi's), and a model may have no template at all.  Where the template
renders no tools, or renders them in a format whose calls mlx-lm cannot parse, the worker serves the
model in mlxq's own call format (``mlxq.shared.tools.own_format``: Hermes's ``<tool_call>`` JSON
blocks, held by the grammar) and renders the conversation for it (:func:`own_tool_messages`):

* the tools, the call format and the rule of ``tool_choice`` go in a system message (after the
  caller's own system text), or at the head of the first user turn for a template that refuses a
  system role (Gemma's raises on one);
* an assistant message with ``tool_calls`` becomes assistant text ending in one ``<tool_call>``
  block per call, as the model would have written them;
* a ``tool`` message becomes a user message ``<tool_response>\\n...\\n</tool_response>`` (such
  templates raise on the role "tool" or drop it), consecutive results in one message;
* for a template that insists on alternating roles (it raises on two user turns in a row),
  consecutive messages of one role are merged into one.

What a template does is found by rendering probes once per tokenizer (:func:`traits`).
"""

from __future__ import annotations

import json
import logging
import threading
import weakref
from dataclasses import dataclass
from typing import Callable, Optional

from ..shared.constraints import ModelFormat
from ..shared.tools import (OWN_CALL_END, OWN_CALL_START, effective_choice, forced_name, own_format, parameters_schema,
                            uses_tools)
from .textstream import chat_format

log = logging.getLogger(__name__)

RESPONSE_START, RESPONSE_END = "<tool_response>", "</tool_response>"
# probes: a tool and a system text no template writes of its own
PROBE_NAME = "mlxq_probe_fn_5e1c"
PROBE_TOOL = {"type": "function", "function": {"name": PROBE_NAME, "description": "mlxq probe",
                                               "parameters": {"type": "object", "properties": {}}}}
PROBE_SYSTEM = "mlxq probe rule 5e1c"
PROBE_USER = [{"role": "user", "content": "hi"}]


@dataclass(frozen=True)
class TemplateTraits:
    """What a chat template does with tools and roles (found by :func:`traits`)."""

    renders_tools: bool  # it writes the tools it is given into the prompt
    system_role: bool = True  # it takes a system message (and writes its text)
    repeated_roles: bool = True  # it takes two user messages in a row


_traits: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_formats: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_lock = threading.Lock()  # the fetcher thread tokenizes while the main thread may read the model's info


def _cached(table, tokenizer, make):
    with _lock:
        try:
            return table[tokenizer]
        except (KeyError, TypeError):
            pass
    value = make(tokenizer)
    with _lock:
        try:
            table[tokenizer] = value
        except TypeError:  # not weak-referenceable: found again each time
            pass
    return value


def traits(tokenizer) -> TemplateTraits:
    """Render probe conversations through the tokenizer's chat template (once per tokenizer): does it
    write a tool it is given, take a system message, take two user turns in a row?  A model with no
    template is rendered as role-prefixed plain text, which takes anything but tools."""
    return _cached(_traits, tokenizer, _find_traits)


def _render(tokenizer, messages, tools=None) -> Optional[str]:
    try:
        return tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    except Exception:  # noqa: BLE001 - templates are user code: raising is the answer sought
        return None


def _find_traits(tokenizer) -> TemplateTraits:
    if not getattr(tokenizer, "chat_template", None) or not hasattr(tokenizer, "apply_chat_template"):
        return TemplateTraits(renders_tools=False)
    with_tool = _render(tokenizer, PROBE_USER, [PROBE_TOOL])
    system = _render(tokenizer, [{"role": "system", "content": PROBE_SYSTEM}, *PROBE_USER])
    repeated = _render(tokenizer, PROBE_USER + [{"role": "user", "content": "again"}])
    found = TemplateTraits(renders_tools=with_tool is not None and PROBE_NAME in with_tool,
                           system_role=system is not None and PROBE_SYSTEM in system,
                           repeated_roles=repeated is not None)
    log.info("chat template: %s", found)
    return found


def serving_format(tokenizer) -> ModelFormat:
    """The format the worker serves the model in (and publishes): mlx-lm's markers
    (:func:`~mlxq.worker.textstream.chat_format`), with mlxq's own call format where the template
    renders no tools or mlx-lm knows no parser for its calls."""
    return _cached(_formats, tokenizer, _serving_format)


def _serving_format(tokenizer) -> ModelFormat:
    fmt = chat_format(tokenizer)
    if fmt.tool_parser and traits(tokenizer).renders_tools:
        return fmt
    return own_format(fmt, tokenizer)


def call_parser(tokenizer, fmt: ModelFormat) -> Optional[Callable]:
    """The parser of a call block's inside: mlx-lm's for the template's family, or json_tools's for
    mlxq's own format."""
    if fmt.mlxq_tools:
        from mlx_lm.tool_parsers import json_tools

        return json_tools.parse_tool_call
    return getattr(tokenizer, "tool_parser", None)


# -- the conversation --------------------------------------------------------------------------

def call_block(fn: dict) -> str:
    """One call as the model writes it in mlxq's format (arguments as chat templates render JSON)."""
    args = fn.get("arguments")
    if not isinstance(args, str):
        args = json.dumps(args if args is not None else {}, ensure_ascii=False)
    name = json.dumps(fn.get("name"), ensure_ascii=False)
    return f'{OWN_CALL_START}\n{{"name": {name}, "arguments": {args}}}\n{OWN_CALL_END}'


def tools_text(tools: list[dict], choice, named: Optional[str], parallel: bool) -> str:
    """The system text that describes the tools: each as JSON ({name, description, parameters}), the
    call format, and what ``tool_choice`` / ``parallel_tool_calls`` ask (the grammar enforces it)."""
    lines = []
    for t in tools:
        fn = t["function"]
        spec = {"name": fn["name"]}
        if fn.get("description"):
            spec["description"] = fn["description"]
        spec["parameters"] = parameters_schema(fn.get("parameters"))
        lines.append(json.dumps(spec, ensure_ascii=False))
    if named is not None:
        rule = f"Call the function {named} now."
    elif choice == "required":
        rule = "Call a function now." if not parallel else "Call one or more functions now."
    else:
        rule = ("Call a function only when it helps; otherwise answer in plain text."
                + ("" if parallel else " Make one call at most."))
    return ("You can call these functions (each is a JSON object with its name, description and parameters, "
            "a JSON schema):\n" + "\n".join(lines) + "\n\n"
            f"To call a function, write a {OWN_CALL_START} block with a JSON object of its name and arguments, "
            f"exactly like this:\n{OWN_CALL_START}\n"
            '{"name": "<function name>", "arguments": <the arguments, a JSON object>}\n'
            f"{OWN_CALL_END}\n"
            f"Results come back in {RESPONSE_START}{RESPONSE_END} blocks. {rule}")


def own_tool_messages(messages: list[dict], req, found: TemplateTraits) -> list[dict]:
    """``messages`` (as chat templates read them: ``jobs.template_message``) rendered for a template
    with no tool slot: the tools described in a system message or the first user turn (when the
    request uses them), calls and results as text (the module's docstring says how)."""
    out: list[dict] = []
    results = False  # the last message out holds tool results
    for m in messages:
        if m["role"] == "tool":
            block = f"{RESPONSE_START}\n{m.get('content') or ''}\n{RESPONSE_END}"
            if results:
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block})
            results = True
            continue
        results = False
        calls = [c.get("function") or {} for c in m.get("tool_calls") or ()]
        m = {k: v for k, v in m.items() if k not in ("tool_calls", "tool_call_id")}
        if calls:
            text = m.get("content") or ""
            m["content"] = (text + "\n" if text else "") + "\n".join(call_block(fn) for fn in calls)
        out.append(m)
    text = None
    if uses_tools(req):
        text = tools_text([t.model_dump(exclude_none=True) for t in req.tools], effective_choice(req),
                          forced_name(req), req.parallel_tool_calls)
    out = _with_system(out, text, found.system_role)
    if not found.repeated_roles:
        out = _merged(out)
    return out


def _with_system(messages: list[dict], text: Optional[str], system_role: bool) -> list[dict]:
    """``text`` (the tools' description; None: none) after the caller's system text, in the first
    message's system turn; for a template that takes no system role, the system text and ``text``
    head the first user turn instead."""
    out = list(messages)
    if system_role:
        if text is None:
            return out
        if out and out[0]["role"] == "system":
            own = out[0].get("content") or ""
            out[0] = {**out[0], "content": (own + "\n\n" if own else "") + text}
        else:
            out.insert(0, {"role": "system", "content": text})
        return out
    head = []
    while out and out[0]["role"] == "system":
        head.append(out.pop(0).get("content") or "")
    head = [h for h in head + [text] if h]
    if not head:
        return out
    if out and out[0]["role"] == "user":
        out[0] = {**out[0], "content": "\n\n".join(head + [out[0].get("content") or ""])}
    else:
        out.insert(0, {"role": "user", "content": "\n\n".join(head)})
    return out


def _merged(messages: list[dict]) -> list[dict]:
    """Consecutive messages of one role as one (for a template that insists on alternating roles)."""
    out: list[dict] = []
    for m in messages:
        if out and out[-1]["role"] == m["role"]:
            out[-1] = {**out[-1], "content": "\n\n".join(x for x in (out[-1].get("content"), m.get("content")) if x)}
        else:
            out.append(dict(m))
    return out
