"""``mlxq submit`` with an output constraint: --json-schema / --json / --regex / --choice give output that
validates (the tiny model's weights are random-ish: only the constraint makes it valid); two constraints
at once, an unreadable file or a bad schema are clear errors, before anything is queued."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import redis

from mlxq.cli import build_parser, main
from mlxq.cli.submit import CUT_SHORT
from mlxq.shared.keys import GlobalKeys
from workerkit import fast_settings, running_worker, wait_for

KEYS = GlobalKeys().model_keys("tiny")
NOWHERE = "redis://127.0.0.1:1/0"  # nothing listens there: an error that comes first never connects

# enums, integer bounds, a nested object and an array; bounded lengths so that any valid output ends
# well within MAX_TOKENS whatever the weights say
SCHEMA = {
    "type": "object",
    "properties": {
        "label": {"enum": ["spam", "ham", "unsure"]},
        "score": {"type": "integer", "minimum": 0, "maximum": 10},
        "author": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}},
                   "required": ["name"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
    },
    "required": ["label", "score", "author", "tags"],
    "additionalProperties": False,
}
SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "triage", "schema": SCHEMA, "strict": True}}
MAX_TOKENS = 400
REGEX = r"[a-z]{2,6}-[0-9]{2}"
CHOICES = ("red", "green", "blue")
BAD_SCHEMA = {"type": "nonsense"}  # valid JSON, not a JSON Schema
BAD_REGEX = "([a-z"  # does not compile
GRAMMARS = (('start: ("yes" | "no") " " /[0-9]{2}/\n', r"(yes|no) [0-9]{2}"),  # Lark
            ('root ::= ("up" | "down") "-" [a-c] [a-c]\n', r"(up|down)-[a-c]{2}"))  # GBNF


def bad_formats() -> list[dict]:
    """Constraints the request's validation refuses: a bad schema, a regex that does not compile."""
    return [{"type": "json_schema", "json_schema": {"name": "bad", "schema": BAD_SCHEMA}},
            {"type": "regex", "pattern": BAD_REGEX}]


def no_thinking(loaded) -> dict[int, float]:
    """A logit bias that keeps a model with a reasoning block (the tiny model's chat template has one)
    from opening it: the constraint allows thinking first, and a random-ish model may think until
    max_tokens.  Nothing for a model without one."""
    from mlxq.shared.constraints import ModelFormat

    return {i: -100.0 for i in ModelFormat.from_tokenizer(loaded.tokenizer).think_start_ids[:1]}


def submitted(r) -> int:
    return int(r.hget(KEYS.counts, "submitted") or 0)


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


@pytest.mark.parametrize("flags", [
    ("--regex", "a+", "--choice", "a"),
    ("--json", "--json-schema", "s.json"),
    ("--grammar", "g.lark", "--regex", "a"),
    ("--choice", "a", "--json"),
])
def test_two_constraints_at_once_are_a_usage_error(flags, capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["submit", "hello", *flags])
    assert exc.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err


def test_bad_options_are_clear_errors_before_connecting(tmp_path, capsys):
    """Each error names its flag (or the field); the Redis URL points nowhere, so none of them got as far as
    connecting."""
    not_json, a_list, a_string = tmp_path / "bad.json", tmp_path / "list.json", tmp_path / "str.json"
    not_json.write_text("{not json")
    a_list.write_text("[1, 2]")
    a_string.write_text('"f"')
    cases = [
        (["--json-schema", str(not_json)], "--json-schema", "not valid JSON"),
        (["--json-schema", str(tmp_path / "missing.json")], "--json-schema", "cannot read it"),
        (["--json-schema", str(a_list)], "--json-schema", "is an object"),
        (["--grammar", str(tmp_path / "missing.lark")], "--grammar", "cannot read it"),
        (["--tools", str(a_string)], "--tools", "tool definitions"),
        (["--tools", str(not_json)], "--tools", "not valid JSON"),
        (["--json-schema", "-", "--tools", "-"], "stdin", "only one"),
        (["--tool-choice", "required"], "--tool-choice", "needs --tools"),
        (["--regex", BAD_REGEX], "response_format (regex)", "invalid regex"),
    ]
    for flags, names, says in cases:
        rc, out, err = run_cli(capsys, "submit", "hello", "--redis-url", NOWHERE, *flags)
        assert rc == 2 and out == "", flags
        assert err.startswith("mlxq submit: ") and "Error: " in err and names in err and says in err, (flags, err)
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["submit", "hello", "--logit-bias", "12"])
    assert exc.value.code == 2 and "TOKEN_ID=BIAS" in capsys.readouterr().err


def test_output_options_become_request_fields(tmp_path, monkeypatch):
    import io

    from mlxq.cli.output import output_params

    schema, tools = tmp_path / "Ticket triage.json", tmp_path / "tools.json"
    schema.write_text(json.dumps(SCHEMA))
    tools.write_text(json.dumps({"type": "function", "function": {"name": "f"}}))  # one tool: a list of one
    parse = build_parser().parse_args
    assert output_params(parse(["submit", "x", "--json-schema", str(schema)])) == {
        "response_format": {"type": "json_schema",
                            "json_schema": {"name": "Ticket_triage", "schema": SCHEMA, "strict": True}}}
    assert output_params(parse(["submit", "x", "--choice", "a", "--choice", "b,c"])) == {
        "response_format": {"type": "choice", "choices": ["a", "b,c"]}}
    got = output_params(parse(["submit", "x", "--tools", str(tools), "--tool-choice", "f", "--presence-penalty",
                               "0.5", "--frequency-penalty", "-1", "--logit-bias", "7=-100", "--logit-bias", "9=2.5"]))
    assert got == {"tools": [{"type": "function", "function": {"name": "f"}}],
                   "tool_choice": {"type": "function", "function": {"name": "f"}},
                   "presence_penalty": 0.5, "frequency_penalty": -1.0, "logit_bias": {7: -100.0, 9: 2.5}}
    assert output_params(parse(["submit", "x", "--tools", str(tools), "--tool-choice", "required"]))["tool_choice"] \
        == "required"
    monkeypatch.setattr("sys.stdin", io.StringIO(json.dumps({"title": "From stdin", **SCHEMA})))
    fmt = output_params(parse(["submit", "x", "--json-schema", "-"]))["response_format"]
    assert fmt["json_schema"]["name"] == "From_stdin" and fmt["json_schema"]["schema"]["required"] == SCHEMA["required"]


def test_submit_with_a_constraint_prints_output_that_validates(tiny_model, redis_url, tmp_path, capsys):
    schema_file = tmp_path / "triage.json"
    schema_file.write_text(json.dumps(SCHEMA))
    settings = fast_settings(redis_url)
    r = redis.Redis.from_url(redis_url)
    base = ["--redis-url", redis_url, "--queue", "tiny", "--max-tokens", str(MAX_TOKENS)]
    base += [a for i in no_thinking(tiny_model) for a in ("--logit-bias", f"{i}=-100")]
    with running_worker(tiny_model, redis_url, settings, max_batch=4):
        assert wait_for(lambda: r.hexists(GlobalKeys().models, "tiny"), timeout=30)
        for seed in range(4):  # sampled: the constraint, not the weights, makes the output valid
            sampled = ["--temperature", "1.0", "--seed", str(seed)]
            rc, out, err = run_cli(capsys, "submit", f"Triage ticket {seed}:", *base, *sampled,
                                   "--json-schema", str(schema_file))
            assert rc == 0, err
            jsonschema.validate(json.loads(out), SCHEMA)
            assert CUT_SHORT not in err  # the schema's lengths are bounded: it always completes
            # any JSON object: unbounded, so a random-ish model may run out of tokens (and the CLI says so)
            rc, out, err = run_cli(capsys, "submit", "Any JSON:", *base, *sampled, "--json")
            assert rc == 0 and out.startswith("{"), (out, err)
            if CUT_SHORT not in err:
                assert isinstance(json.loads(out), dict), (out, err)
            rc, out, err = run_cli(capsys, "submit", "A code:", *base, *sampled, "--regex", REGEX)
            assert rc == 0 and re.fullmatch(REGEX, out.rstrip("\n")), (out, err)
            rc, out, err = run_cli(capsys, "submit", "A colour:", *base, *sampled,
                                   *[a for c in CHOICES for a in ("--choice", c)])
            assert rc == 0 and out.rstrip("\n") in CHOICES, (out, err)
        # a grammar file, Lark or GBNF
        for text, pattern in GRAMMARS:
            grammar = tmp_path / "g.txt"
            grammar.write_text(text)
            rc, out, err = run_cli(capsys, "submit", "Say:", *base, "--grammar", str(grammar))
            assert rc == 0 and re.fullmatch(pattern, out.rstrip("\n")), (text, out, err)
        done = submitted(r)
        assert done == 16 + len(GRAMMARS)
        # a schema, regex or grammar the grammar engine refuses: a clear error, and nothing queued
        schema_file.write_text(json.dumps(BAD_SCHEMA))
        (tmp_path / "bad.lark").write_text("start: undefined_rule\n")
        for flags in (["--json-schema", str(schema_file)], ["--regex", BAD_REGEX],
                      ["--grammar", str(tmp_path / "bad.lark")]):
            rc, out, err = run_cli(capsys, "submit", "hello", *base, *flags)
            assert rc == 2 and out == "" and err.startswith("mlxq submit: "), (flags, err)
            assert "response_format" in err, err
        assert submitted(r) == done
    r.close()


WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}


def test_submit_with_a_named_tool_prints_the_call(tiny_model, redis_url, tmp_path, capsys):
    """``--tools FILE --tool-choice NAME``: the call is constrained by the tool's parameter schema, and the
    CLI prints it as a last JSON line ``{"tool_calls": [...]}`` whose arguments validate."""
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps([{"type": "function", "function": {
        "name": "get_weather", "description": "The forecast for a city", "parameters": WEATHER}}]))
    settings = fast_settings(redis_url)
    argv = ["submit", "Weather in Paris this week?", "--redis-url", redis_url, "--queue", "tiny", "--max-tokens",
            "200", "--tools", str(tools), "--tool-choice", "get_weather", "--temperature", "1.0"]
    argv += [a for i in no_thinking(tiny_model) for a in ("--logit-bias", f"{i}=-100")]
    with running_worker(tiny_model, redis_url, settings, max_batch=4):
        for seed in range(3):
            rc, out, err = run_cli(capsys, *argv, "--seed", str(seed))
            assert rc == 0, err
            calls = json.loads(out.rstrip("\n").splitlines()[-1])["tool_calls"]
            assert [c["function"]["name"] for c in calls] == ["get_weather"], calls
            jsonschema.validate(json.loads(calls[0]["function"]["arguments"]), WEATHER)
