"""Anthropic's Messages API through the gateway, driven by the real ``anthropic`` client: a real
Valkey, a real worker on the tiny model, the real gateway, one of each for the module.  The tiny
model's text is whatever its weights make of it: each answer is compared with the same request
through Chat Completions in the same run (greedy), or held to what the constraint makes it."""

from __future__ import annotations

import asyncio
import http.client
import json
import time
from urllib.parse import urlparse

import anthropic
import jsonschema
import openai
import pytest

from mlxq.devkit.make_model import THINK_END, THINK_START
from mlxq.shared import apikeys, codec
from mlxq.shared.keys import GlobalKeys
from toolcallkit import WEATHER
from workerkit import fast_settings, job_fields, raw_post, running_worker, wait_for

from mlxq.producer.gateway import ServerThread, create_app

GK = GlobalKeys()
KEY = "messages-key-0001"  # a registered key, tier high
SYSTEM = "You are terse."
ASK = [{"role": "user", "content": "Tell me about the sea."}]
TOOLS = [{"name": "get_weather", "description": "Weather in a city", "input_schema": WEATHER}]


@pytest.fixture(scope="module")
def stack(redis_server, tiny_model):
    """(gateway url, redis, the model's tokenizer): a worker serving "tiny" for the module, a key."""
    import redis

    r = redis.Redis.from_url(redis_server.url)
    r.flushall()
    apikeys.add_key(r, GK.api_keys, KEY, "high")
    # a stream that waits for its first token past half a second starts with pings
    settings = fast_settings(redis_server.url, sse_keepalive_s=0.5)
    with running_worker(tiny_model, redis_server.url, settings, max_batch=8):
        assert wait_for(lambda: r.hexists(GK.models, "tiny"), timeout=60)
        with ServerThread(create_app(redis_server.url, settings)) as url:
            yield url, r, tiny_model.tokenizer
    r.close()


def claude(url: str, key: str = KEY) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key=key, max_retries=0, timeout=60)


def chat(url: str, **kw):
    """The same request through Chat Completions (Bearer: the same key)."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60)
    return client.chat.completions.create(model="tiny", **kw)


def no_thought(tok) -> dict:
    """A bias that keeps the tiny model from opening a thought (mlxq's ``logit_bias`` extension):
    whether its untrained ``<think>`` outranks the answer is up to its random weights."""
    return {str(tok.get_vocab()[THINK_START]): -100}


def text_of(message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def submitted(r) -> int:
    return int(r.hget(GK.model_keys("tiny").counts, "submitted") or 0)


def test_create_is_the_chat_completions_answer(stack):
    url, r, _ = stack
    # (temperature and top_k in the body, as the API takes them: the anthropic client has no arguments
    # for them from its 1.0 on)
    msg = claude(url).messages.create(model="tiny", system=SYSTEM, messages=ASK, max_tokens=12,
                                      metadata={"user_id": "u-1"}, extra_body={"temperature": 0, "top_k": 0})
    want = chat(url, messages=[{"role": "system", "content": SYSTEM}, *ASK], max_tokens=12, temperature=0)
    assert msg.type == "message" and msg.role == "assistant" and msg.model == "tiny" and msg.id.startswith("msg_")
    assert text_of(msg) == (want.choices[0].message.content or "")
    thinking = [b.thinking for b in msg.content if b.type == "thinking"]
    assert "".join(thinking) == (want.choices[0].message.model_extra.get("reasoning_content") or "")
    assert msg.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[want.choices[0].finish_reason]
    u = msg.usage
    assert u.input_tokens + u.cache_read_input_tokens == want.usage.prompt_tokens
    assert u.output_tokens == want.usage.completion_tokens
    job = job_fields(r, GK.model_keys("tiny").job(msg.id.removeprefix("msg_")))
    assert job["tier"] == b"high"  # x-api-key: the key's tier


def test_stream_gives_the_final_message(stack):
    url, _, tok = stack
    kw = dict(model="tiny", messages=ASK, max_tokens=16, extra_body={"logit_bias": no_thought(tok)})
    whole = claude(url).messages.create(**kw)
    with claude(url).messages.stream(**kw) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(pieces) == text_of(final) == text_of(whole)
    assert final.id.startswith("msg_") and final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == \
        whole.usage.input_tokens + whole.usage.cache_read_input_tokens


def test_thinking_streams_as_thinking_blocks(stack):
    url, _, tok = stack
    vocab = tok.get_vocab()
    # the bias opens a thought and never closes it: all the output is thinking
    bias = {str(vocab[THINK_START]): 100, str(vocab[THINK_END]): -100}
    kw = dict(model="tiny", messages=ASK, max_tokens=8, thinking={"type": "enabled", "budget_tokens": 1024},
              extra_body={"logit_bias": bias})
    whole = claude(url).messages.create(**kw)
    assert [b.type for b in whole.content] == ["thinking"] and whole.content[0].thinking
    with claude(url).messages.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking"] and final.content[0].thinking == whole.content[0].thinking
    assert sum(e.type == "thinking" for e in events) > 1  # it streamed, piece by piece


def test_tool_use_has_a_valid_input_streamed_or_not(stack):
    url, _, tok = stack
    kw = dict(model="tiny", messages=[{"role": "user", "content": "Weather in Paris?"}], max_tokens=200,
              tools=TOOLS, tool_choice={"type": "tool", "name": "get_weather"},
              extra_body={"logit_bias": no_thought(tok)})
    msg = claude(url).messages.create(**kw)
    calls = [b for b in msg.content if b.type == "tool_use"]
    assert msg.stop_reason == "tool_use" and len(calls) == 1 and calls[0].name == "get_weather"
    assert isinstance(calls[0], anthropic.types.ToolUseBlock) and calls[0].id
    jsonschema.validate(calls[0].input, WEATHER)
    with claude(url).messages.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert [(b.type, b.name, b.input) for b in final.content if b.type == "tool_use"] == \
        [("tool_use", "get_weather", calls[0].input)]
    assert final.stop_reason == "tool_use"
    assert sum(e.type == "input_json" for e in events) > 1  # the input streamed as the model wrote it


def test_output_config_format_holds_the_answer_to_its_schema(stack):
    url, _, tok = stack
    msg = claude(url).messages.create(model="tiny", messages=ASK, max_tokens=200, extra_body={
        "output_config": {"format": {"type": "json_schema", "schema": WEATHER}}, "logit_bias": no_thought(tok)})
    assert msg.stop_reason == "end_turn"
    jsonschema.validate(json.loads(text_of(msg)), WEATHER)


def test_a_tool_result_round_trip_is_the_chat_completions_one(stack):
    url, _, tok = stack
    first = claude(url).messages.create(model="tiny", messages=[{"role": "user", "content": "Weather in Paris?"}],
                                        max_tokens=200, tools=TOOLS,
                                        tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                        extra_body={"logit_bias": no_thought(tok)})
    (call,) = [b for b in first.content if b.type == "tool_use"]  # one call: disable_parallel_tool_use
    turns = [{"role": "user", "content": "Weather in Paris?"},
             {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "sunny"}]}]
    after = claude(url).messages.create(model="tiny", messages=turns, max_tokens=10, tools=TOOLS,
                                        tool_choice={"type": "none"})
    assert after.stop_reason in ("end_turn", "max_tokens") and not [b for b in after.content if b.type == "tool_use"]
    # the same turns as Chat Completions sends them: the same prompt, so the same greedy answer
    oai_turns = [{"role": "user", "content": "Weather in Paris?"},
                 {"role": "assistant", "content": text_of(first) or None, "tool_calls": [
                     {"id": call.id, "type": "function",
                      "function": {"name": call.name, "arguments": json.dumps(call.input)}}]},
                 {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    tools = [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                               "parameters": t["input_schema"]}} for t in TOOLS]
    want = chat(url, messages=oai_turns, max_tokens=10, tools=tools, tool_choice="none", temperature=0)
    assert text_of(after) == (want.choices[0].message.content or "")


def test_stop_sequences_and_max_tokens_say_how_it_stopped(stack):
    url, _, tok = stack
    kw = dict(model="tiny", messages=ASK, extra_body={"logit_bias": no_thought(tok), "ignore_eos": True})
    cut = claude(url).messages.create(max_tokens=3, **kw)
    assert cut.stop_reason == "max_tokens" and cut.stop_sequence is None and cut.usage.output_tokens == 3
    whole = text_of(claude(url).messages.create(max_tokens=12, **kw))
    assert len(whole) >= 4, whole
    stop = whole[2:4]
    stopped = claude(url).messages.create(max_tokens=12, stop_sequences=["never-written-1", stop], **kw)
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == stop
    assert text_of(stopped) == whole[:whole.index(stop)]
    with claude(url).messages.stream(max_tokens=12, stop_sequences=[stop], **kw) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence, text_of(final)) == ("stop_sequence", stop, text_of(stopped))


def test_count_tokens_is_the_prompt_the_worker_renders(stack):
    url, _, _ = stack
    count = claude(url).messages.count_tokens(model="tiny", system=SYSTEM, messages=ASK)
    want = chat(url, messages=[{"role": "system", "content": SYSTEM}, *ASK], max_tokens=1)
    assert count.input_tokens == want.usage.prompt_tokens
    with_tools = claude(url).messages.count_tokens(model="tiny", messages=ASK, tools=TOOLS)
    assert with_tools.input_tokens > claude(url).messages.count_tokens(model="tiny", messages=ASK).input_tokens


def test_keys_and_errors_are_anthropics(stack):
    url, r, _ = stack
    with pytest.raises(anthropic.AuthenticationError) as e:
        claude(url, "not-a-key").messages.create(model="tiny", messages=ASK, max_tokens=2)
    assert e.value.body["error"]["type"] == "authentication_error"
    before = submitted(r)
    bad = [dict(messages=[{"role": "user", "content": [{"type": "image", "source": {
               "type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}]),
           dict(messages=ASK, tools=TOOLS, tool_choice={"type": "tool", "name": "nope"}),
           dict(messages=ASK, tools=[{"type": "web_search_20250305", "name": "web_search"}]),
           dict(messages=ASK, extra_body={"temperature": 1.5}),
           dict(messages=ASK, extra_body={"frobnicate": 1})]
    for kw in bad:
        with pytest.raises(anthropic.BadRequestError) as e:
            claude(url).messages.create(model="tiny", max_tokens=4, **kw)
        assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    status, out = raw_post(url, "/v1/messages", {"model": "tiny", "messages": ASK}, {"x-api-key": KEY})
    assert status == 400 and "max_tokens" in out["error"]["message"]  # required, as Anthropic has it
    status, out = raw_post(url, "/v1/messages", {"model": "nope", "messages": ASK, "max_tokens": 2},
                           {"x-api-key": KEY})
    assert status == 404 and out["error"]["type"] == "not_found_error"
    assert submitted(r) == before  # nothing was queued
    status, out = raw_post(url, "/v1/messages/nothing", {}, {"x-api-key": KEY})
    assert status == 404 and out == {"type": "error", "error": {"type": "not_found_error",
                                                                 "message": out["error"]["message"]}}
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    conn.request("GET", "/v1/messages", headers={"x-api-key": KEY})
    resp = conn.getresponse()
    assert resp.status == 405 and json.loads(resp.read())["error"]["type"] == "invalid_request_error"
    conn.close()
    status, out = raw_post(url, "/v1/nothing", {}, {"x-api-key": KEY})  # OpenAI's shape elsewhere
    assert status == 404 and set(out["error"]) == {"message", "type", "param", "code"}
    assert claude(url).messages.create(model="tiny", messages=ASK, max_tokens=2).stop_reason  # alive


def test_a_stream_waiting_in_the_queue_pings_and_its_disconnect_cancels_the_job(stack):
    """No worker serves "ghost" (a registry entry that looks alive): the job stays queued, the stream
    starts with message_start and pings, and a client that leaves cancels the job."""
    url, r, _ = stack
    ghost = GK.model_keys("ghost")
    r.hset(GK.models, "ghost", codec.pack({"name": "ghost", "context_length": 4096, "max_token_bytes": 8,
                                           "seen_at": time.time() + 10 * 365 * 86400}))
    try:
        u = urlparse(url)
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
        body = {"model": "ghost", "messages": ASK, "max_tokens": 4, "stream": True}
        conn.request("POST", "/v1/messages", json.dumps(body), {"Content-Type": "application/json", "x-api-key": KEY})
        resp = conn.getresponse()
        assert resp.status == 200 and resp.getheader("content-type").startswith("text/event-stream")
        events = []
        while "ping" not in events:
            line = resp.fp.readline().decode()
            if line.startswith("event: "):
                events.append(line.removeprefix("event: ").strip())
        assert events[0] == "message_start"
        (job_id,) = [m.decode() for m in r.zrange(ghost.queue, 0, -1)]
        conn.sock.close()
        conn.close()
        assert wait_for(lambda: r.hget(ghost.job(job_id), "status") == b"cancelled", timeout=15)
    finally:
        r.hdel(GK.models, "ghost")


def test_a_refusal_after_the_headers_is_an_error_event():
    """The worker refused the job after a ping sent the headers: Anthropic's error event ends the
    stream (the anthropic client raises it), with no message_stop."""
    from mlxq.producer.gateway import Gateway
    from mlxq.producer.gateway.jobs import KEEPALIVE, Submitted
    from mlxq.producer.gateway.messages import Messages, _Answer
    from mlxq.shared.schemas import INVALID_REQUEST, Delta, Result
    from mlxq.shared.settings import Settings

    class Job:
        id = "ab" * 16

        async def result(self, timeout=None):
            return Result(id=self.id, finish_reason="error", error="the prompt is too long", error_code=INVALID_REQUEST)

    async def stream():
        gw = Gateway(settings=Settings(redis_url="redis://unused"))

        async def deltas():
            yield KEEPALIVE
            yield Delta(seq=1, finish_reason="error", error="the prompt is too long")

        answer = _Answer(Submitted(Job(), "tiny", None, False), 4, "normal", 0.0)
        return [e async for e in Messages(gw)._sse(answer, deltas())]

    events = asyncio.run(stream())
    assert [e.split("\n")[0] for e in events] == ["event: message_start", "event: ping", "event: error"]
    error = json.loads(events[-1].split("data: ", 1)[1])
    assert error == {"type": "error", "error": {"type": "invalid_request_error", "message": "the prompt is too long"}}


def test_blocks_become_chat_messages_in_their_order():
    """A turn's blocks as the chat template reads them: an assistant's thought dropped, its text and
    calls one message; each tool result a tool message named after its call, text after it a user
    message after it."""
    from mlxq.producer.anthropic_api import InMessage, mlxq_messages

    turns = [InMessage(role="user", content="hi"),
             InMessage(role="assistant", content=[
                 {"type": "thinking", "thinking": "hm", "signature": ""}, {"type": "text", "text": "Let me look."},
                 {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Paris"}}]),
             InMessage(role="user", content=[
                 {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "sunny"}]},
                 {"type": "text", "text": "thanks"}])]
    call = {"id": "t1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    assert mlxq_messages([{"type": "text", "text": "Be brief."}], turns) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "t1", "content": "sunny", "name": "get_weather"},
        {"role": "user", "content": "thanks"}]


def test_every_finish_has_its_stop_reason():
    from mlxq.producer.anthropic_api import stop_fields
    from mlxq.shared.schemas import Result

    def fields(reason, n=4, **kw):
        return stop_fields(Result(id="j", finish_reason=reason, token_ids=list(range(n)), **kw), 4)

    assert fields("stop") == {"stop_reason": "end_turn", "stop_sequence": None}
    assert fields("stop", stop="##") == {"stop_reason": "stop_sequence", "stop_sequence": "##"}
    assert fields("tool_calls")["stop_reason"] == "tool_use"
    assert fields("length")["stop_reason"] == "max_tokens"
    assert fields("length", n=3)["stop_reason"] == "model_context_window_exceeded"  # capped before max_tokens
    assert fields("timeout", n=1) == {"stop_reason": "max_tokens", "stop_sequence": None,
                                      "mlxq_stop_reason": "timeout"}
    assert fields("cancelled")["stop_reason"] == "end_turn" and fields("cancelled")["mlxq_stop_reason"] == "cancelled"
