"""A request's output constraint as an llguidance grammar, checked before anything is queued.

``response_format`` (OpenAI's shapes plus mlxq's) becomes one llguidance grammar
(a JSON string any ``llguidance.LLMatcher`` takes):

* ``{"type": "text"}`` (or none): no constraint;
* ``{"type": "json_object"}``: any JSON object;
* ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}``:
  llguidance's JSON-schema compiler, compact separators and no free whitespace (an
  output is one line, and every byte the model spends is content);
* ``{"type": "regex", "pattern": ...}``: the whole output matches the pattern;
* ``{"type": "choice", "choices": [...]}``: exactly one of the strings;
* ``{"type": "grammar", "grammar": ...}``: a Lark grammar (llguidance's dialect) or a
  GBNF one (llama.cpp's), converted with ``llguidance.gbnf_to_lark``.

:func:`compile_format` (run by ``GenerateRequest``'s validation through
``mlxq.shared.grammars.check_request``, so every producer surface refuses a bad constraint before
queueing) compiles and validates the grammar without a tokenizer; results are cached by the
response_format's compact JSON, so 10,000 identical bulk jobs cost one compile.
:func:`grammar_for` places it after the model's reasoning block (:class:`ModelFormat`); tool calls
are ``mlxq.shared.tools``'s, and ``mlxq.shared.grammars`` picks between the two.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from typing import Any, Optional

FORMAT_TYPES = ("text", "json_object", "json_schema", "regex", "choice", "grammar")
# llguidance's JSON compiler options: compact separators, no whitespace between tokens
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
MAX_CHOICES = 1024
ANY_TEXT = "/(?s:.*)/"  # a Lark lexeme of any text
MAX_MESSAGE = 300
_LOCATION = re.compile(r"^at \d+\(\d+\): ")  # where in the Lark wrapper mlxq wrote: no use to the user


class ConstraintError(ValueError):
    """A constraint that cannot be compiled; the message is one line, fit for a 400."""


@dataclass(frozen=True)
class ModelFormat:
    """What the worker knows of a model's output format (from mlx-lm's ``TokenizerWrapper``).

    ``think_*``: the reasoning markers (a constraint applies to the answer after them);
    ``*_ids``: their token ids when each is one token; ``in_thinking``: the prompt ends
    inside a reasoning block (the template opened it); ``tool_*``: the model's tool-call
    markers and mlx-lm's parser name for them; ``mlxq_tools``: they are mlxq's own call format,
    not the template's (a template with no tool slot: mlxq describes the tools in the prompt itself,
    ``mlxq.shared.tools.own_format``).
    """

    think_start: Optional[str] = None
    think_end: Optional[str] = None
    think_start_ids: tuple[int, ...] = ()
    think_end_ids: tuple[int, ...] = ()
    in_thinking: bool = False
    tool_call_start: Optional[str] = None
    tool_call_end: Optional[str] = None
    tool_parser: Optional[str] = None
    tool_call_start_ids: tuple[int, ...] = ()
    tool_call_end_ids: tuple[int, ...] = ()
    tool_markers_special: bool = False  # the tool-call markers are special tokens (never plain text)
    mlxq_tools: bool = False

    @classmethod
    def from_tokenizer(cls, tok) -> "ModelFormat":
        """Read an mlx-lm ``TokenizerWrapper``'s markers (missing attributes: none)."""
        start = getattr(tok, "think_start", None) if getattr(tok, "has_thinking", False) else None
        return cls(
            think_start=start,
            think_end=getattr(tok, "think_end", None) if start else None,
            think_start_ids=tuple(getattr(tok, "think_start_tokens", None) or ()) if start else (),
            think_end_ids=tuple(getattr(tok, "think_end_tokens", None) or ()) if start else (),
            tool_call_start=getattr(tok, "tool_call_start", None),
            tool_call_end=getattr(tok, "tool_call_end", None),
            tool_parser=_parser_name(getattr(tok, "tool_parser", None)),
            tool_call_start_ids=tuple(getattr(tok, "tool_call_start_tokens", None) or ()),
            tool_call_end_ids=tuple(getattr(tok, "tool_call_end_tokens", None) or ()),
            tool_markers_special=special_marker(tok, getattr(tok, "tool_call_start_tokens", None)),
        )


def special_marker(tok, ids) -> bool:
    """``ids`` is one token that plain text never matches in a grammar: a special token, or any token
    added to the vocabulary.  llguidance treats every added token as special, whatever its "special"
    flag (Qwen2.5's and Qwen3's ``<tool_call>`` is added with ``special: false``), so such a marker is
    written in a grammar as its token, never as its text."""
    hf = getattr(tok, "_tokenizer", tok)
    if not ids or len(ids) != 1:
        return False
    if ids[0] in set(getattr(hf, "all_special_ids", None) or ()):
        return True
    try:
        added = getattr(hf, "added_tokens_decoder", None) or {}
    except Exception:  # noqa: BLE001 - a tokenizer without the table: not known to be added
        added = {}
    return ids[0] in added


def _parser_name(parser) -> Optional[str]:
    if parser is None or isinstance(parser, str):
        return parser
    return getattr(parser, "__module__", "").rsplit(".", 1)[-1] or None


# ================================================================ response_format -> grammar
def _one_line(msg: str) -> str:
    """llguidance's messages span lines (a caret under the spot); keep the words, on one line."""
    keep = []
    for line in _LOCATION.sub("", str(msg)).splitlines():
        s = line.strip()
        if not s or set(s) <= {"^", " "} or (s[:1].isdigit() and " | " in s):
            continue
        keep.append(s)
    text = "; ".join(keep)
    return text if len(text) <= MAX_MESSAGE else text[:MAX_MESSAGE - 3] + "..."


def _field(fmt: dict, name: str, kind: type, what: str):
    value = fmt.get(name)
    if not isinstance(value, kind) or (kind is str and not value):
        raise ConstraintError(f"response_format type {fmt['type']!r} needs {name!r}: {what}")
    return value


def _lark_json(schema: dict) -> str:
    from llguidance import LLMatcher

    return LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)


def _schema_of(fmt: dict) -> dict:
    if fmt["type"] == "json_object":
        return {"type": "object"}
    spec = _field(fmt, "json_schema", dict, 'an object {"name": ..., "schema": {...}}')
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise ConstraintError("response_format.json_schema.schema must be a JSON schema (an object)")
    return closed(schema) if spec.get("strict") is True else schema


def closed(schema: Any) -> Any:
    """``_closed(schema)``; a schema nested too deeply for it is a ConstraintError (a 400), where the
    RecursionError was an unhandled 500."""
    try:
        return _closed(schema)
    except RecursionError:
        raise ConstraintError("the JSON schema is nested too deeply to close for strict: true") from None


# keywords whose values are data, not subschemas, and those that map names to subschemas
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples", "example"})
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


def _closed(schema: Any) -> Any:
    """A copy of ``schema`` where every object that does not say otherwise has
    ``additionalProperties: false``: what ``strict: true`` means in OpenAI's structured outputs
    (its SDK closes a pydantic class's objects the same way).  Without it a model may write keys
    the schema never named, and a pydantic class with its default ``extra="ignore"`` would still
    validate, but only after the model spent its tokens on them."""
    if isinstance(schema, list):
        return [_closed(x) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for k, v in schema.items():
        if k in _DATA_KEYWORDS:  # values, not schemas: {"const": {"type": "object"}} stays what it says
            out[k] = v
        elif k in _SCHEMA_MAPS and isinstance(v, dict):  # name -> schema (a property may be named "const")
            out[k] = {name: _closed(sub) for name, sub in v.items()}
        else:
            out[k] = _closed(v)
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _grammar_text(fmt: dict) -> str:
    """The raw llguidance grammar of a (shape-checked) response_format; may still be invalid."""
    from llguidance import LLMatcher, regex_to_lark

    kind = fmt["type"]
    if kind in ("json_object", "json_schema"):
        return _lark_json(_schema_of(fmt))
    if kind == "regex":
        pattern = _field(fmt, "pattern", str, "a regular expression")
        return LLMatcher.grammar_from_lark(f"start: /{regex_to_lark(pattern)}/")
    if kind == "choice":
        choices = _field(fmt, "choices", list, "a list of strings")
        if not 1 <= len(choices) <= MAX_CHOICES or not all(isinstance(c, str) and c for c in choices):
            raise ConstraintError(f"response_format.choices must be 1..{MAX_CHOICES} non-empty strings")
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
    return LLMatcher.grammar_from_lark(_lark_of(_field(fmt, "grammar", str, "Lark or GBNF text")))


def _lark_of(text: str) -> str:
    from llguidance.gbnf_to_lark import any_to_lark

    try:
        return any_to_lark(text)
    except Exception as exc:  # GbnfToLarkError and friends: the user's grammar text
        raise ConstraintError(f"response_format.grammar: GBNF does not convert to Lark: {_one_line(exc)}") from None


# The keys each response_format type takes, and json_schema's own: any other is refused, not ignored
# (ignored, a {"type": "json_object", "schema": ...} as some providers write it would constrain nothing
# but the object, and a "strict": "true" string would not be strict).
FORMAT_KEYS = {"text": {"type"}, "json_object": {"type"}, "json_schema": {"type", "json_schema"},
               "regex": {"type", "pattern"}, "choice": {"type", "choices"}, "grammar": {"type", "grammar"}}
JSON_SCHEMA_KEYS = {"name", "schema", "strict", "description"}
SCHEMA_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def _kind(fmt: Any) -> str:
    if not isinstance(fmt, dict):
        raise ConstraintError("response_format must be an object with a 'type'")
    kind = fmt.get("type")
    if kind not in FORMAT_TYPES:
        raise ConstraintError(f"response_format.type must be one of {', '.join(FORMAT_TYPES)} (got {kind!r})")
    extra = sorted(set(fmt) - FORMAT_KEYS[kind])
    if extra:
        hint = ' (a schema goes in {"type": "json_schema", "json_schema": {"name": ..., "schema": ...}})' \
            if kind == "json_object" and "schema" in extra else ""
        raise ConstraintError(f"response_format type {kind!r} takes no {', '.join(map(repr, extra))}{hint}")
    spec = fmt.get("json_schema")
    if kind == "json_schema" and isinstance(spec, dict):
        extra = sorted(set(spec) - JSON_SCHEMA_KEYS)
        if extra:
            raise ConstraintError(f"response_format.json_schema takes no {', '.join(map(repr, extra))} "
                                  f"(it takes {', '.join(sorted(JSON_SCHEMA_KEYS))})")
        if "strict" in spec and spec["strict"] is not None and not isinstance(spec["strict"], bool):
            raise ConstraintError("response_format.json_schema.strict must be true or false")
        name = spec.get("name")
        if name is not None and not (isinstance(name, str) and SCHEMA_NAME.fullmatch(name)):
            raise ConstraintError("response_format.json_schema.name must match [A-Za-z0-9_-]{1,64}")
    return kind


@functools.lru_cache(maxsize=512)
def _compiled(canonical: str) -> tuple[Optional[str], Optional[str]]:
    """(grammar, None) or (None, error message) for a canonical response_format JSON."""
    from llguidance import LLMatcher

    fmt = json.loads(canonical)
    try:
        if _kind(fmt) == "text":
            return None, None
        grammar = _grammar_text(fmt)
    except ConstraintError as exc:
        return None, str(exc)
    except (ValueError, TypeError) as exc:  # llguidance refusing its input outright
        return None, f"response_format ({fmt['type']}): {_one_line(exc)}"
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        return None, f"response_format ({fmt['type']}): {_one_line(messages[0] if messages else 'invalid')}"
    return grammar, None


def canonical(fmt: Any) -> str:
    """The cache key of a response_format: compact JSON, keys in their order (a schema's property
    order is its output's order, so it is part of the constraint)."""
    try:
        return json.dumps(fmt, separators=(",", ":"), ensure_ascii=False)
    except (TypeError, ValueError, RecursionError) as exc:
        raise ConstraintError(f"response_format must be JSON: {exc}") from None


def compile_format(fmt: Optional[dict]) -> Optional[str]:
    """The llguidance grammar of a response_format (None: no constraint); ConstraintError otherwise."""
    if fmt is None:
        return None
    grammar, error = _compiled(canonical(fmt))
    if error:
        raise ConstraintError(error)
    return grammar


# ================================================================ requests
def grammar_for(req, fmt: Optional[ModelFormat] = None) -> Optional[str]:
    """The grammar of ``req``'s response_format (None: free text), after the model's reasoning block
    when its format (``fmt``) has one.  Tool calls are not this module's: a request with tools takes
    its grammar from ``mlxq.shared.grammars.grammar_for``."""
    fmt = fmt or ModelFormat()
    grammar = compile_format(req.response_format)
    if grammar is None or not fmt.think_start or req.messages is None:  # a raw prompt's output is all answer
        return grammar
    return after_thinking(grammar, fmt)


def marker_item(text: Optional[str], ids: tuple[int, ...]) -> str:
    """A Lark item for a marker (of reasoning or of a tool call): its token by id when it is one
    token, else its text."""
    return f"<[{ids[0]}]>" if len(ids) == 1 else json.dumps(text)


def without_text(text: str) -> str:
    """A Lark lexeme body (llguidance's ``&`` and ``~``): any text that does not hold ``text``."""
    return f"{ANY_TEXT} & ~({ANY_TEXT} {json.dumps(text)} {ANY_TEXT})"


def grammar_list(grammar: str) -> list[dict]:
    """A grammar as llguidance's list of grammars: its JSON form's, or one Lark grammar (what
    ``LLMatcher.grammar_from_lark`` returns is the Lark text itself)."""
    if grammar.lstrip().startswith("{"):
        return json.loads(grammar)["grammars"]
    return [{"lark_grammar": grammar}]


def after_thinking(grammar: str, fmt: ModelFormat, never: Optional[str] = None) -> str:
    """``grammar`` placed after an optional reasoning block (already open when ``fmt.in_thinking``):
    the constraint applies to the answer, not to the thinking.  An end marker that is one token ends
    the thought where the model writes it (a text lexeme never matches it); one spelled by several
    tokens ends it where the thought's text first holds it (a lazy lexeme), as the output's split
    reads it.  ``never``: text the thought may not hold (a tool-call marker that is text: a call
    written in the thought would be parsed, unconstrained)."""
    answer = grammar_list(grammar)
    start = marker_item(fmt.think_start, fmt.think_start_ids)
    text = without_text(never) if never else ANY_TEXT
    if len(fmt.think_end_ids) == 1:
        rules = f"thought: THOUGHT <[{fmt.think_end_ids[0]}]>\n"
    else:
        rules = f"thought[lazy]: THOUGHT {json.dumps(fmt.think_end)}\n"
    head = "thought" if fmt.in_thinking else f"({start} thought)?"
    top = {"lark_grammar": f"start: {head} @answer\n{rules}THOUGHT: {text}\n", "name": "start"}
    answer[0] = dict(answer[0], name="answer")
    return json.dumps({"grammars": [top] + answer})
