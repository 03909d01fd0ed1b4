"""The Responses API's shapes without I/O: input items as chat messages, refusals by name, and the
stream's events from a job's deltas agreeing with the finished job's output items."""

from __future__ import annotations

import pytest

from mlxq.producer.openai_api import OpenAIError
from mlxq.producer.responses_api import ResponseEvents, ResponsesRequest, output_items
from mlxq.shared.schemas import Delta, Result, ToolCall

JOB = "0" * 32


def kwargs(**body) -> dict:
    return ResponsesRequest.model_validate({"model": "m", "input": "hi", **body}).submit_kwargs()


def test_input_items_become_chat_messages():
    call = {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}", "id": "fc_x", "status": "x"}
    kw = kwargs(instructions="be brief", input=[
        {"role": "developer", "content": "rules"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"},
                                                        {"type": "input_text", "text": "b"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "let me see"}]},
        call, {**call, "call_id": "call_2"},
        {"type": "function_call_output", "call_id": "call_2", "output": "2"}])
    calls = [{"id": c, "type": "function", "function": {"name": "f", "arguments": "{}"}} for c in ("call_1", "call_2")]
    assert kw["messages"] == [
        {"role": "system", "content": "be brief"}, {"role": "system", "content": "rules"},
        {"role": "user", "content": "ab"}, {"role": "assistant", "content": "let me see", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "call_2", "content": "2", "name": "f"}]


def test_format_and_tools_in_chat_completions_shape():
    kw = kwargs(text={"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}, "strict": True}},
                tools=[{"type": "function", "name": "f", "parameters": {"type": "object"}}],
                tool_choice={"type": "function", "name": "f"}, max_output_tokens=7)
    assert kw["response_format"] == {"type": "json_schema",
                                     "json_schema": {"name": "x", "schema": {"type": "object"}, "strict": True}}
    assert kw["tools"] == [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert kw["tool_choice"] == {"type": "function", "function": {"name": "f"}} and kw["max_tokens"] == 7


@pytest.mark.parametrize("body,param", [
    ({"tools": [{"type": "web_search_preview"}]}, "tools.0"),
    ({"tools": [{"type": "function", "name": "f", "defer_loading": True}]}, "tools.0.defer_loading"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input.0.type 'item_reference'"),
    ({"truncation": "auto"}, "truncation"),
    ({"include": ["message.output_text.logprobs"]}, "include.message.output_text.logprobs"),
    ({"text": {"format": {"type": "grammar"}}}, "text.format.type 'grammar'"),
])
def test_what_cannot_be_honoured_is_refused_by_name(body, param):
    with pytest.raises(OpenAIError) as err:
        kwargs(**body)
    assert err.value.status == 400 and err.value.param == param


def _call(k: int, args: str) -> ToolCall:
    return ToolCall(id=f"call_{k}", function={"name": "f", "arguments": args})


def _stream(deltas: list[Delta], tools: bool) -> tuple[list[dict], list[dict]]:
    ev = ResponseEvents("resp_" + JOB, JOB, tools)
    events = ev.start({"status": "in_progress"})
    for d in deltas:
        events += ev.feed(d)
    events += ev.finish({"status": "completed"})
    return events, ev.items


def test_whitespace_before_calls_is_no_answer_and_the_items_match_the_result():
    deltas = [Delta(seq=1, text="\n"),
              Delta(seq=2, partial_call_id="call_0", partial_call_name="f", partial_args='{"a"'),
              Delta(seq=3, tool_calls=[_call(0, '{"a":1}')], offset=1, text="\n"),
              Delta(seq=4, tool_calls=[_call(1, "{}")], tool_call_index=1, finish_reason="tool_calls")]
    events, items = _stream(deltas, tools=True)
    res = Result(id=JOB, text="\n\n", tool_calls=[_call(0, '{"a":1}'), _call(1, "{}")], finish_reason="tool_calls")
    assert items == output_items(JOB, res, "completed")
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert not any(e["type"].startswith("response.output_text") for e in events)
    assert "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"
                   and e["output_index"] == 0) == '{"a":1}'


def test_reasoning_then_answer_and_a_replay_numbers_the_same():
    deltas = [Delta(seq=1, reasoning="hm"), Delta(seq=2, reasoning=" ok", reasoning_offset=2, text="Hi"),
              Delta(seq=3, text=" there", offset=2, finish_reason="stop")]
    events, items = _stream(deltas, tools=False)
    res = Result(id=JOB, text="Hi there", reasoning="hm ok", finish_reason="stop")
    assert items == output_items(JOB, res, "completed")
    assert [e["type"] for e in events if e["type"].endswith(".done")] == [
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert _stream(deltas, tools=False)[0] == events  # a function of the deltas alone
    empty, items = _stream([Delta(seq=1, finish_reason="stop")], tools=True)
    assert items == output_items(JOB, Result(id=JOB, finish_reason="stop"), "completed")  # an empty answer
