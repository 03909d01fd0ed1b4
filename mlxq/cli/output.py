"""Output options of ``mlxq submit`` and ``mlxq batch``: one constraint, tools, penalties, logit bias,
a time limit.

``add_output_options`` declares them on a sub-command's parser (the constraints are mutually
exclusive: argparse refuses two of them with a usage error); ``output_params`` turns the parsed
flags into request fields (``response_format``, ``tools``, ``tool_choice``, ``presence_penalty``,
``frequency_penalty``, ``logit_bias``, ``timeout_s``), reading the files they name.  A file that cannot be read or
is not the JSON it should be raises ValueError naming the flag; whether a schema, regex or grammar
is usable is decided by the request's own validation (``GenerateRequest``), before anything is
queued.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import Any, Optional

TOOL_CHOICES = ("none", "auto", "required")
STDIN = "-"


def logit_bias_pair(text: str) -> tuple[int, float]:
    """``ID=BIAS`` (argparse type): a token id and the bias added to its logit."""
    tok, sep, bias = text.partition("=")
    try:
        if not sep:
            raise ValueError
        return int(tok), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected TOKEN_ID=BIAS (e.g. 42=-100), got {text!r}") from None


def add_output_options(p: argparse.ArgumentParser, note: Optional[str] = None) -> None:
    """Declare the output options in three groups; ``note`` describes them (e.g. how lines override them)."""
    g = p.add_argument_group("structured output (one of these)", note)
    one = g.add_mutually_exclusive_group()
    one.add_argument("--json-schema", metavar="FILE",
                     help="constrain the output to JSON valid for this JSON Schema file ('-': stdin) "
                          "(default: no constraint)")
    one.add_argument("--json", action="store_true", help="constrain the output to a JSON object")
    one.add_argument("--regex", metavar="RE", help="constrain the output to match this regex "
                                                   "(default: no constraint)")
    one.add_argument("--choice", action="append", metavar="TEXT",
                     help="constrain the output to one of these strings; repeat for each (default: none)")
    one.add_argument("--grammar", metavar="FILE",
                     help="constrain the output to this Lark or GBNF grammar file ('-': stdin) "
                          "(default: no constraint)")
    t = p.add_argument_group("tool calls")
    t.add_argument("--tools", metavar="FILE",
                   help="a JSON file of OpenAI tool definitions (a list of {\"type\": \"function\", "
                        "\"function\": {name, description, parameters}}); rendered by the chat template "
                        "(default: no tools)")
    t.add_argument("--tool-choice", metavar="CHOICE",
                   help="none, auto, required, or the name of one tool to call (needs --tools) "
                        "(default: auto when --tools is given)")
    from ..shared.schemas import MAX_N

    p.add_argument_group("samples").add_argument(
        "--n", type=int, metavar="N",
        help=f"samples of the prompt (1..{MAX_N}), each its own output; they share the prompt's KV "
             "(default: 1)")
    p.add_argument_group("time limit").add_argument(
        "--timeout-s", type=float, metavar="SECONDS",
        help="end the job with finish_reason timeout and its tokens so far once it has run this long "
             "(execution time, from when a worker takes it; above 0) (default: no limit)")
    s = p.add_argument_group("penalties")
    s.add_argument("--presence-penalty", type=float, metavar="P",
                   help="subtracted once from the logit of every token already generated (-2..2) (default: 0)")
    s.add_argument("--frequency-penalty", type=float, metavar="P",
                   help="subtracted per occurrence from the logit of generated tokens (-2..2) (default: 0)")
    s.add_argument("--logit-bias", type=logit_bias_pair, action="append", metavar="ID=BIAS",
                   help="add BIAS (-100..100) to token ID's logit; repeat for several (default: none)")


def output_params(args: argparse.Namespace) -> dict[str, Any]:
    """The request fields the output options set (only those given); ValueError for a file that
    cannot be read or parsed, or a --tool-choice without --tools."""
    if [getattr(args, n, None) for n in ("json_schema", "grammar", "tools")].count(STDIN) > 1:
        raise ValueError("only one of --json-schema, --grammar and --tools can read stdin ('-')")
    out: dict[str, Any] = {}
    fmt = response_format(args)
    if fmt is not None:
        out["response_format"] = fmt
    if args.tools is not None:
        out["tools"] = read_tools(args.tools)
    if args.tool_choice is not None:
        if args.tools is None:
            raise ValueError("--tool-choice needs --tools")
        out["tool_choice"] = tool_choice(args.tool_choice)
    for name in ("presence_penalty", "frequency_penalty", "n", "timeout_s"):
        if getattr(args, name) is not None:
            out[name] = getattr(args, name)
    if args.logit_bias:
        out["logit_bias"] = dict(args.logit_bias)
    return out


def response_format(args: argparse.Namespace) -> Optional[dict]:
    """The ``response_format`` of the constraint flag given, if any."""
    if args.json_schema is not None:
        schema = read_json(args.json_schema, "--json-schema")
        if not isinstance(schema, dict):
            raise ValueError(f"--json-schema {args.json_schema}: a JSON Schema is an object, "
                             f"not {type(schema).__name__}")
        return {"type": "json_schema",
                "json_schema": {"name": schema_name(args.json_schema, schema), "schema": schema, "strict": True}}
    if args.json:
        return {"type": "json_object"}
    if args.regex is not None:
        return {"type": "regex", "pattern": args.regex}
    if args.choice is not None:
        return {"type": "choice", "choices": list(args.choice)}
    if args.grammar is not None:
        return {"type": "grammar", "grammar": read_text(args.grammar, "--grammar")}
    return None


def schema_name(path: str, schema: dict) -> str:
    """OpenAI's ``json_schema.name`` (``[A-Za-z0-9_-]{1,64}``): the schema's title, else the file's name."""
    title = schema.get("title") if isinstance(schema.get("title"), str) else None
    base = title or ("stdin" if path == STDIN else os.path.splitext(os.path.basename(path))[0])
    return re.sub(r"[^A-Za-z0-9_-]", "_", base)[:64] or "schema"


def read_tools(path: str) -> list:
    tools = read_json(path, "--tools")
    if isinstance(tools, dict):
        tools = tools.get("tools", [tools])  # {"tools": [...]} or one tool
    if not isinstance(tools, list) or not tools:
        raise ValueError(f"--tools {path}: expected a JSON list of tool definitions")
    return tools


def tool_choice(text: str) -> Any:
    return text if text in TOOL_CHOICES else {"type": "function", "function": {"name": text}}


def read_text(path: str, flag: str) -> str:
    try:
        if path == STDIN:
            return sys.stdin.read()
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{flag} {path}: cannot read it: {exc}") from None


def read_json(path: str, flag: str) -> Any:
    text = read_text(path, flag)
    try:
        return json.loads(text)
    except ValueError as exc:
        raise ValueError(f"{flag} {path}: not valid JSON: {exc}") from None
