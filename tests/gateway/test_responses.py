"""OpenAI's Responses API through the gateway, driven by the official ``openai`` client (and the
openai-agents SDK's Responses model): a real Valkey, one worker on the tiny model and one gateway for
the module.  The tiny model's text is random-ish: every answer is compared with the same request
through Chat Completions (greedy) in the same run, and structured outputs are asserted by what the
library parsed."""

from __future__ import annotations

import json
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel

from mlxq.devkit.make_model import THINK_END, THINK_START
from mlxq.shared import codec
from mlxq.shared.keys import GlobalKeys
from toolcallkit import SCHEMAS, WEATHER
from mlxq.producer.gateway import ServerThread, create_app
from workerkit import fast_settings, raw_post, serving_gateway, wait_for

K = GlobalKeys().model_keys("tiny")
SYSTEM = "You are terse."
QUESTION = "Tell me about the sea."


class Pick(BaseModel):
    """A constrained output type: any weights give a valid instance, soon."""
    topic: Literal["sea", "sky"]
    mood: Literal["calm", "wild"]


@pytest.fixture(scope="module")
def stack(redis_server, tiny_model):
    """(gateway url, redis, extra_body with a bias that keeps the tiny model from opening a thought)."""
    with serving_gateway(tiny_model, redis_server.url, max_batch=8) as (url, r):
        vocab = tiny_model.tokenizer.get_vocab()
        yield url, r, {"logit_bias": {str(vocab[THINK_START]): -100}}


def oai(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="EMPTY", max_retries=0, timeout=120)


def chat_text(url: str, extra: dict, messages: list[dict], **kw) -> str:
    resp = oai(url).chat.completions.create(model="tiny", messages=messages, temperature=0, extra_body=extra, **kw)
    return resp.choices[0].message.content


def ask(url: str, extra: dict, **kw):
    kw = {"input": QUESTION, "instructions": SYSTEM, "temperature": 0, "max_output_tokens": 12, "extra_body": extra,
          **kw}
    return oai(url).responses.create(model="tiny", **kw)


def deltas(events) -> str:
    return "".join(e.delta for e in events if e.type == "response.output_text.delta")


def test_plain_and_streamed_equal_chat_completions(stack):
    url, r, extra = stack
    want = chat_text(url, extra, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}],
                     max_tokens=12)
    resp = ask(url, extra)
    assert resp.id.startswith("resp_") and resp.object == "response" and resp.model == "tiny"
    assert resp.output_text == want and resp.status in ("completed", "incomplete")
    assert resp.instructions == SYSTEM and resp.max_output_tokens == 12
    stats = codec.unpack(r.hget(K.job(resp.id.removeprefix("resp_")), "result"))["stats"]
    assert resp.usage.input_tokens == stats["prompt_tokens"] and resp.usage.output_tokens == stats["generated_tokens"]
    assert resp.usage.input_tokens_details.cached_tokens == stats.get("cached_tokens", 0)
    assert resp.usage.output_tokens_details.reasoning_tokens == 0
    # the same long prefix again: its full blocks come from the prefix cache, and usage says so
    again = [ask(url, extra, instructions=SYSTEM * 20, max_output_tokens=2) for _ in range(2)]
    assert 0 < again[1].usage.input_tokens_details.cached_tokens < again[1].usage.input_tokens

    events = list(ask(url, extra, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:4]] == ["response.created", "response.in_progress", "response.output_item.added",
                                            "response.content_part.added"]
    assert events[-1].type in ("response.completed", "response.incomplete")
    assert deltas(events) == want == events[-1].response.output_text
    assert [e.type for e in events[-4:-1]] == ["response.output_text.done", "response.content_part.done",
                                               "response.output_item.done"]
    # a replay of the finished response (its record compacted) numbers the same events the same way
    replay = list(oai(url).responses.retrieve(events[-1].response.id, stream=True))
    assert [e.model_dump() for e in replay] == [e.model_dump() for e in events]

def test_json_schema_is_parsed_by_the_library(stack):
    url, _, extra = stack
    resp = oai(url).responses.parse(model="tiny", input=QUESTION, text_format=Pick, max_output_tokens=40,
                                    temperature=0, extra_body=extra)
    assert isinstance(resp.output_parsed, Pick) and resp.status == "completed"
    # the library's stream helper reassembles the same response (it wants response.completed: a
    # response cut at max_output_tokens ends with response.incomplete, as OpenAI's)
    with oai(url).responses.stream(model="tiny", input=QUESTION, text_format=Pick, max_output_tokens=40,
                                   temperature=0, extra_body=extra) as s:
        final = s.get_final_response()
    assert final.output_parsed == resp.output_parsed and final.output_text == resp.output_text
    obj = oai(url).responses.create(model="tiny", input=QUESTION, max_output_tokens=40, extra_body=extra,
                                    text={"format": {"type": "json_object"}})
    assert obj.status in ("completed", "incomplete")


def test_function_call_equals_chat_completions_and_streams(stack):
    url, _, extra = stack
    tool = {"type": "function", "name": "get_weather", "description": "Weather in a city", "parameters": WEATHER}
    chat = oai(url).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": QUESTION}], temperature=0, max_tokens=80, extra_body=extra,
        tools=[{"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}],
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    want = chat.choices[0].message.tool_calls[0].function
    kw = dict(model="tiny", input=QUESTION, temperature=0, max_output_tokens=80, extra_body=extra, tools=[tool],
              tool_choice={"type": "function", "name": "get_weather"})
    resp = oai(url).responses.create(**kw)
    calls = [o for o in resp.output if o.type == "function_call"]
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", want.arguments)]
    jsonschema.validate(json.loads(calls[0].arguments), SCHEMAS["get_weather"])
    assert calls[0].call_id.startswith("call_")
    events = list(oai(url).responses.create(stream=True, **kw))
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(pieces) > 1 and "".join(pieces) == want.arguments
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [(e.name, e.arguments) for e in done] == [("get_weather", want.arguments)]
    # the call's output goes back as input items, as an agent loop sends them
    after = oai(url).responses.create(model="tiny", temperature=0, max_output_tokens=8, extra_body=extra, tools=[tool],
                                      input=[{"role": "user", "content": QUESTION}, calls[0].model_dump(),
                                             {"type": "function_call_output", "call_id": calls[0].call_id,
                                              "output": "sunny"}], tool_choice="none")
    assert after.output_text == chat_text(url, extra, [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": None, "tool_calls": [{"id": calls[0].call_id, "type": "function",
                                                                "function": {"name": "get_weather",
                                                                             "arguments": want.arguments}}]},
        {"role": "tool", "tool_call_id": calls[0].call_id, "content": "sunny"}],
        max_tokens=8, tools=chat and [{"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}],
        tool_choice="none")


def test_a_thought_is_a_reasoning_item(stack, tiny_model):
    url, _, _ = stack
    vocab = tiny_model.tokenizer.get_vocab()
    # the bias opens a thought and never closes it: all the output is reasoning
    extra = {"logit_bias": {str(vocab[THINK_START]): 100, str(vocab[THINK_END]): -100}}
    fmt = {"format": {"type": "json_object"}}
    chat = oai(url).chat.completions.create(
        model="tiny", messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}],
        temperature=0, max_tokens=12, response_format={"type": "json_object"}, extra_body=extra)
    thought = chat.choices[0].message.model_extra["reasoning_content"]
    resp = ask(url, extra, text=fmt)
    assert [o.type for o in resp.output] == ["reasoning", "message"] and resp.status == "incomplete"
    assert resp.output[0].content[0].text == thought and resp.output_text == ""
    assert resp.usage.output_tokens_details.reasoning_tokens > 0
    events = list(ask(url, extra, text=fmt, stream=True))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == thought
    assert [e.text for e in events if e.type == "response.reasoning_text.done"] == [thought]
    assert [o.model_dump(exclude={"id"}) for o in events[-1].response.output] == \
        [o.model_dump(exclude={"id"}) for o in resp.output]


def test_previous_response_id_goes_on_from_the_conversation(stack):
    url, _, extra = stack
    first = ask(url, extra, input="Hi there.")
    second = ask(url, extra, input="And then?", previous_response_id=first.id)
    assert second.previous_response_id == first.id
    # the earlier instructions are not carried over (as OpenAI): this turn's stand first
    assert second.output_text == chat_text(url, extra, [
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi there."},
        {"role": "assistant", "content": first.output_text}, {"role": "user", "content": "And then?"}], max_tokens=12)
    with pytest.raises(openai.NotFoundError):
        ask(url, extra, input="x", previous_response_id="resp_" + "0" * 32)


def test_background_poll_resume_cancel_delete(stack, redis_server):
    url, r, extra = stack
    want = ask(url, extra, max_output_tokens=30).output_text
    resp = ask(url, extra, max_output_tokens=30, background=True)
    assert resp.status in ("queued", "in_progress") and resp.background
    # nobody reads it now: the gateway left no subscription to its channel behind
    assert r.pubsub_numsub(K.channel(resp.id.removeprefix("resp_"))) == [(K.channel(resp.id[5:]).encode(), 0)]
    assert wait_for(lambda: oai(url).responses.retrieve(resp.id).status in ("completed", "incomplete"), timeout=60)
    assert oai(url).responses.retrieve(resp.id).output_text == want

    # resume: drop the stream after a few events, go on from the last one seen
    stream = ask(url, extra, max_output_tokens=30, background=True, stream=True)
    seen = []
    for ev in stream:
        seen.append(ev)
        if len(seen) == 6:
            break
    stream.close()
    with ServerThread(create_app(redis_server.url, fast_settings(redis_server.url))) as other:
        # another gateway resumes it: the events' numbers follow from the job's deltas alone
        rest = list(oai(other).responses.retrieve(seen[0].response.id, stream=True,
                                                  starting_after=seen[-1].sequence_number))
    numbers = [e.sequence_number for e in seen + rest]
    assert numbers == list(range(len(numbers)))  # no event twice, none missing
    assert deltas(seen + rest) == want == rest[-1].response.output_text

    # cancel a long one, then delete it
    long = ask(url, extra, max_output_tokens=2000, background=True, extra_body={**extra, "ignore_eos": True})
    cancelled = oai(url).responses.cancel(long.id)
    assert cancelled.status == "cancelled"
    oai(url).responses.delete(long.id)
    with pytest.raises(openai.NotFoundError):
        oai(url).responses.retrieve(long.id)
    assert not r.exists(K.job(long.id.removeprefix("resp_")))


def test_store_false_keeps_nothing(stack):
    url, r, extra = stack
    resp = ask(url, extra, store=False)
    assert resp.output_text is not None
    assert wait_for(lambda: not r.exists(K.job(resp.id.removeprefix("resp_"))))
    with pytest.raises(openai.NotFoundError):
        oai(url).responses.retrieve(resp.id)
    events = list(ask(url, extra, store=False, stream=True))
    assert deltas(events) == resp.output_text
    assert wait_for(lambda: not r.exists(K.job(events[0].response.id.removeprefix("resp_"))))


@pytest.mark.parametrize("extra,param", [
    ({"frobnicate": 1}, "frobnicate"),
    ({"tools": [{"type": "web_search"}]}, "tools.0"),
    ({"tools": [{"type": "file_search", "vector_store_ids": ["x"]}]}, "tools.0"),
    ({"background": True, "store": False}, "background"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input.0.content.0"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}}, "text.format"),
    ({"max_tokens": 5}, "max_tokens"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"tool_choice": {"type": "function", "name": "nope"}, "tools": [
        {"type": "function", "name": "f", "parameters": {"type": "object"}}]}, "tool_choice"),
])
def test_bad_input_is_a_400_naming_it_and_queues_nothing(stack, extra, param):
    url, r, _ = stack
    before = r.hget(K.counts, "submitted")
    status, out = raw_post(url, "/v1/responses", {"model": "tiny", "input": "hi", **extra})
    assert status == 400, out
    assert out["error"]["param"] == param and out["error"]["type"] == "invalid_request_error"
    assert r.hget(K.counts, "submitted") == before


def _agents_model(url: str):
    from agents import OpenAIResponsesModel, set_tracing_disabled

    set_tracing_disabled(True)  # its traces go to OpenAI's servers by default
    return OpenAIResponsesModel(model="tiny", openai_client=openai.AsyncOpenAI(
        base_url=f"{url}/v1", api_key="EMPTY", max_retries=0, timeout=120))


def test_openai_agents_responses_model_output_type(stack):
    from agents import Agent, ModelSettings, Runner

    url, _, extra = stack
    agent = Agent(name="pick", instructions=SYSTEM, model=_agents_model(url), output_type=Pick,
                  model_settings=ModelSettings(temperature=0, max_tokens=40, extra_body=extra))
    result = Runner.run_sync(agent, QUESTION)
    assert isinstance(result.final_output, Pick)


def test_openai_agents_responses_model_calls_a_function_tool(stack):
    from agents import Agent, ModelSettings, Runner, function_tool

    url, _, extra = stack
    calls = []

    @function_tool
    def get_mood(topic: Literal["sea", "sky"]) -> str:
        """The mood of a topic."""
        calls.append(topic)
        return f"{topic}: calm"

    agent = Agent(name="mood", instructions=SYSTEM, model=_agents_model(url), tools=[get_mood],
                  tool_use_behavior="stop_on_first_tool",
                  model_settings=ModelSettings(temperature=0, max_tokens=60, tool_choice="required",
                                               parallel_tool_calls=False, extra_body=extra))
    result = Runner.run_sync(agent, QUESTION)
    assert len(calls) == 1 and result.final_output == f"{calls[0]}: calm"


def test_unknown_ids_and_bad_event_numbers_in_openai_error_shape(stack):
    import httpx

    url, _, extra = stack
    for rid in ("resp_nope", "resp_" + "f" * 32):
        with pytest.raises(openai.NotFoundError) as err:
            oai(url).responses.retrieve(rid)
        assert err.value.body["code"] == "response_not_found"
    # a chat completion's job is no stored response
    chat = oai(url).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    with pytest.raises(openai.NotFoundError):
        oai(url).responses.retrieve("resp_" + chat.id.removeprefix("chatcmpl-"))
    resp = ask(url, extra, max_output_tokens=1)
    got = httpx.get(f"{url}/v1/responses/{resp.id}", params={"stream": "true", "starting_after": "x"})
    assert got.status_code == 400 and got.json()["error"]["param"] == "starting_after"
