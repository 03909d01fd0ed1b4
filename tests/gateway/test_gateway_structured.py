"""Structured output, tool calls and reasoning through the gateway, driven by the official ``openai``
client (and LangChain when it is installed): a real Valkey, a real worker on the tiny model, the real
gateway.  The tiny model's weights are random-ish, so only the constraint makes an output valid: the
tests validate with ``jsonschema`` and never expect particular text."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from mlxq import Client
from mlxq.devkit.make_model import THINK_END, THINK_START, TOOL_CALL_START
from mlxq.shared import codec
from mlxq.shared.keys import GlobalKeys
from workerkit import serving_gateway
from workerkit import raw_post
from toolcallkit import SCHEMAS, TOOLS, WEATHER

GK = GlobalKeys()
MESSAGES = [{"role": "user", "content": "Tell me about the sea."}]
RECORD = {
    "type": "object",
    "properties": {
        "topic": {"type": "string", "enum": ["sea", "weather", "music"]},
        "mood": {"type": "string", "enum": ["calm", "wild"]},
        "score": {"type": "integer", "minimum": 0, "maximum": 10},
        "place": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}},
                  "required": ["name"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}, "minItems": 1,
                 "maxItems": 3},
    },
    "required": ["topic", "mood", "score", "place", "tags"],
    "additionalProperties": False,
}
SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "record", "schema": RECORD, "strict": True}}


@pytest.fixture(scope="module")
def stack(redis_server, tiny_model):
    """(gateway url, redis, the model's tokenizer) with a worker serving "tiny" for the module."""
    with serving_gateway(tiny_model, redis_server.url, max_batch=8) as (url, r):
        yield url, r, tiny_model.tokenizer


def oai(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="EMPTY", max_retries=0, timeout=120)


def no_thought(tok) -> dict:
    """A bias that keeps the model from opening a thought.  A constrained answer may begin with one
    (free text up to ``</think>``); the tiny model was never trained on the markers, and whether an
    untrained ``<think>`` outranks the answer's first token is up to its random weights.  Tests that
    are not about reasoning take that choice away."""
    return {str(tok.get_vocab()[THINK_START]): -100}


def chat(url: str, **kw):
    return oai(url).chat.completions.create(model="tiny", messages=kw.pop("messages", MESSAGES), **kw)


def streamed(url: str, **kw):
    """The same request streamed, reassembled by the openai library's own stream helper."""
    with oai(url).chat.completions.stream(model="tiny", messages=kw.pop("messages", MESSAGES), **kw) as s:
        chunks = list(s)
        return s.get_final_completion(), chunks


def check_calls(message, names=tuple(SCHEMAS)) -> None:
    assert message.tool_calls
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


# -- response_format ---------------------------------------------------------------------------------

def test_json_schema_plain_and_streamed(stack):
    url, _, tok = stack
    plain = chat(url, response_format=SCHEMA_FORMAT, max_tokens=200, logit_bias=no_thought(tok))
    assert plain.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(plain.choices[0].message.content), RECORD)
    final, _ = streamed(url, response_format=SCHEMA_FORMAT, max_tokens=200, logit_bias=no_thought(tok))
    assert final.choices[0].message.content == plain.choices[0].message.content  # greedy: the same answer
    many = [chat(url, response_format=SCHEMA_FORMAT, max_tokens=200, temperature=1.0, seed=s,
                 logit_bias=no_thought(tok)) for s in range(8)]
    for resp in many:
        jsonschema.validate(json.loads(resp.choices[0].message.content), RECORD)


def test_json_object(stack):
    url, _, tok = stack
    vocab = tok.get_vocab()
    # the bias only hurries the object closed (any weights): the constraint makes it an object.
    # '"' outranks '}', which a string may also hold: with the two equal, a model that prefers '}'
    # wrote '{"":"}}}...' to max_tokens (MLXQ_TEST_MODEL_SEED=212). So every string closes as soon
    # as it opens, and the object at its first '}' (compact JSON: no whitespace to loop on).
    bias = {**no_thought(tok), **{str(vocab[t]): b for t, b in (('"', 100), ("}", 50)) if t in vocab}}
    resp = chat(url, response_format={"type": "json_object"}, max_tokens=200, logit_bias=bias)
    assert resp.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(resp.choices[0].message.content), dict)


# -- tools -------------------------------------------------------------------------------------------

def test_tool_choice_required_and_named(stack):
    url, _, tok = stack
    # one call (parallel calls: how many is the model's choice, and a random-ish one may not stop)
    resp = chat(url, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=200,
                logit_bias=no_thought(tok))
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    check_calls(choice.message)
    named = {"type": "function", "function": {"name": "get_time"}}
    resp = chat(url, tools=TOOLS, tool_choice=named, max_tokens=200, temperature=0.9, seed=3,
                logit_bias=no_thought(tok))
    assert resp.choices[0].finish_reason == "tool_calls"
    check_calls(resp.choices[0].message, ("get_time",))
    assert len(resp.choices[0].message.tool_calls) == 1


def test_streamed_tool_calls_reassemble_in_the_openai_library(stack):
    url, _, tok = stack
    named = {"type": "function", "function": {"name": "get_weather"}}
    kw = dict(tools=TOOLS, tool_choice=named, max_tokens=200, logit_bias=no_thought(tok))
    plain = chat(url, **kw)
    final, chunks = streamed(url, **kw)
    msg = final.choices[0].message
    assert final.choices[0].finish_reason == "tool_calls"
    check_calls(msg, ("get_weather",))
    want = plain.choices[0].message.tool_calls
    assert [(c.id != "", c.function.name, c.function.arguments) for c in msg.tool_calls] == \
        [(True, c.function.name, c.function.arguments) for c in want]
    assert any(ev.type == "tool_calls.function.arguments.done" for ev in chunks)
    assert sum(ev.type == "tool_calls.function.arguments.delta" for ev in chunks) > 1  # they streamed
    # the raw chunks: OpenAI's tool-call delta shape: a call's first entry names it (index, id, name),
    # the next ones carry more of its arguments only, and the pieces add up to the whole call's
    raw = list(oai(url).chat.completions.create(model="tiny", messages=MESSAGES, stream=True, **kw))
    deltas = [tc for c in raw if c.choices for tc in c.choices[0].delta.tool_calls or ()]
    for k, call in enumerate(want):
        mine = [d for d in deltas if d.index == k]
        assert mine[0].id and mine[0].function.name == call.function.name and mine[0].type == "function"
        assert all(d.id is None and d.function.name is None for d in mine[1:]) and len(mine) > 1
        assert "".join(d.function.arguments or "" for d in mine) == call.function.arguments
    assert sorted({d.index for d in deltas}) == list(range(len(want)))
    assert raw[-1].choices[0].finish_reason == "tool_calls"


def test_auto_calls_are_constrained_once_the_model_starts_one(stack):
    url, _, tok = stack
    vocab = tok.get_vocab()
    # the bias makes the model open a call (the lazy path runs by construction); the grammar does the rest
    bias = {**no_thought(tok), str(vocab[TOOL_CALL_START]): 100}
    resp = chat(url, tools=TOOLS, parallel_tool_calls=False, logit_bias=bias, max_tokens=200)
    assert resp.choices[0].finish_reason == "tool_calls"
    check_calls(resp.choices[0].message)
    assert len(resp.choices[0].message.tool_calls) == 1
    # an agent loop: the call and its result go back in, as the openai client sends them
    call = resp.choices[0].message.tool_calls[0]
    loop = MESSAGES + [resp.choices[0].message.model_dump(exclude_none=True),
                       {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    after = chat(url, messages=loop, tools=TOOLS, tool_choice="none", max_tokens=8)
    assert after.choices[0].finish_reason in ("stop", "length") and after.choices[0].message.tool_calls is None


# -- reasoning ---------------------------------------------------------------------------------------

def test_reasoning_content_apart_from_content(stack, redis_server):
    url, _, tok = stack
    vocab = tok.get_vocab()
    # the bias opens a thought and never closes it; the answer's constraint keeps other special
    # tokens out of the thought: all the output is reasoning
    bias = {str(vocab[THINK_START]): 100, str(vocab[THINK_END]): -100}
    kw = dict(response_format={"type": "json_object"}, max_tokens=12, logit_bias=bias)
    plain = chat(url, **kw).choices[0]
    assert plain.finish_reason == "length" and plain.message.content == ""
    reasoning = plain.message.model_extra["reasoning_content"]
    assert reasoning and THINK_START not in reasoning
    raw = list(oai(url).chat.completions.create(model="tiny", messages=MESSAGES, stream=True, **kw))
    parts = [c.choices[0].delta.model_extra.get("reasoning_content") for c in raw if c.choices]
    assert "".join(p for p in parts if p) == reasoning
    assert not "".join(c.choices[0].delta.content or "" for c in raw if c.choices)
    # where the thought ends is the model's choice: the split follows the tokens, whatever they are
    client = Client(redis_server.url, model="tiny")
    res = client.submit(messages=MESSAGES, response_format=SCHEMA_FORMAT, max_tokens=80,
                        logit_bias={vocab[THINK_START]: 100.0}).result(timeout=120)
    gw = chat(url, response_format=SCHEMA_FORMAT, max_tokens=80, logit_bias={str(vocab[THINK_START]): 100})
    ids = res.token_ids
    assert ids[0] == vocab[THINK_START]
    end = ids.index(vocab[THINK_END]) if vocab[THINK_END] in ids else len(ids)
    assert (res.reasoning or "") == tok.decode(ids[1:end]) == (gw.choices[0].message.model_extra.get("reasoning_content") or "")
    assert res.text == tok.decode(ids[end + 1:]) == gw.choices[0].message.content
    if res.finish_reason == "stop":  # the constraint held for the answer after the thought
        jsonschema.validate(json.loads(res.text), RECORD)


# -- parameters --------------------------------------------------------------------------------------

def body(**kw) -> dict:
    return {"model": "tiny", "messages": MESSAGES, "max_tokens": 4, **kw}


@pytest.mark.parametrize("extra,param", [
    ({"reasoning_effort": "high"}, "reasoning_effort"),
    ({"frobnicate": 1}, "frobnicate"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "nope"}}}}}]}, "tools"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format"),
    ({"logit_bias": {"999999": 5}}, "logit_bias"),
    ({"logit_bias": {"abc": 5}}, "logit_bias"),
    ({"presence_penalty": 3.0}, "presence_penalty"),
    ({"messages": [{"role": "user", "content": "hi", "audio": {"id": "x"}}]}, "messages.0.audio"),
    ({"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
     "stream_options.continuous_usage_stats"),
])
def test_what_would_change_the_output_is_honoured_or_refused_by_name(stack, extra, param):
    url, _, _ = stack
    status, out = raw_post(url, "/v1/chat/completions", body(**extra))
    assert status == 400, out
    assert out["error"]["param"] == param and out["error"]["type"] == "invalid_request_error"


def test_harmless_metadata_passes_and_penalties_reach_the_job(stack):
    url, r, _ = stack
    status, out = raw_post(url, "/v1/chat/completions", body(
        user="u-1", metadata={"k": "v"}, store=False, presence_penalty=0.5, frequency_penalty=1.5,
        logit_bias={"10": -5}))
    assert status == 200, out
    req = codec.unpack(r.hget(GK.model_keys("tiny").job(out["id"].removeprefix("chatcmpl-")), "req"))
    assert (req["presence_penalty"], req["frequency_penalty"], req["logit_bias"]) == (0.5, 1.5, {"10": -5.0})
    status, _ = raw_post(url, "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2,
                                                  "user": "u", "response_format": {"type": "json_object"}})
    assert status == 200
    # the worker kept serving through all the refusals
    assert chat(url, max_tokens=3).choices[0].finish_reason in ("stop", "length")


# -- LangChain -------------------------------------------------------------------------------------

def test_langchain_structured_output(stack):
    langchain_openai = pytest.importorskip("langchain_openai")
    from pydantic import BaseModel, Field
    from typing import Literal

    class Weather(BaseModel):
        """The weather in a city."""

        city: Literal["Paris", "Rome", "Zürich"]
        days: int = Field(ge=1, le=5)
        units: Literal["C", "F"]

    url, _, tok = stack
    llm = langchain_openai.ChatOpenAI(model="tiny", base_url=f"{url}/v1", api_key="EMPTY", temperature=0,
                                      max_tokens=120, max_retries=0, timeout=120, logit_bias=no_thought(tok))
    for method in ("json_schema", "function_calling"):
        # strict: no properties beyond the schema's (a random-ish model would invent them forever)
        out = llm.with_structured_output(Weather, method=method, strict=True).invoke("What is the weather in Paris?")
        assert isinstance(out, Weather), method
        jsonschema.validate(out.model_dump(), WEATHER)
