"""Tool calling and reasoning, worker side: the test model's template and markers, the split of a chat
job's output into answer, reasoning and tool calls (and its resume), the tool-call grammar under
llguidance, and tool jobs end to end through a real worker on a real Valkey."""

from __future__ import annotations

import dataclasses
import json
import types

import jsonschema
import llguidance
import llguidance.hf
import pytest

from mlxq import Client
from mlxq.devkit.make_model import TOOL_CALL_END, TOOL_CALL_START, THINK_END, THINK_START, format_chat
from mlxq.shared.constraints import ModelFormat
from mlxq.shared.schemas import GenerateRequest
from mlxq.shared.tools import ToolError, check_tools, format_from_info, format_info, tool_grammar
from mlxq.worker.jobs import ActiveJob, Published, chat_stream, job_grammar, prompt_in_thinking, tokenize
from mlxq.worker.textstream import ChatStream, TextStream, chat_format
from toolcallkit import MESSAGES, SCHEMAS, TOOLS, check_calls, sample
from workerkit import fast_settings, read_published, running_worker


def request(**kw) -> GenerateRequest:
    return GenerateRequest.model_validate({"model": "tiny", "messages": MESSAGES, "tools": TOOLS, **kw})


# -- the test model's template ----------------------------------------------------------------------

def test_template_renders_tools_calls_and_results_and_mlx_lm_infers_the_format(tiny_model):
    tok = tiny_model.tokenizer
    vocab = tok.get_vocab()
    for marker in (THINK_START, THINK_END, TOOL_CALL_START, TOOL_CALL_END):  # one token each
        assert tok.encode(marker, add_special_tokens=False) == [vocab[marker]]
    assert tok.tool_parser is not None and tok.tool_call_start == TOOL_CALL_START
    assert tok.has_thinking and tok.think_start == THINK_START
    fmt = chat_format(tok)
    assert fmt.tool_parser == "json_tools" and fmt.tool_markers_special
    assert fmt.tool_call_start_ids == (vocab[TOOL_CALL_START],) and fmt.think_end_ids == (vocab[THINK_END],)
    agent_loop = [
        {"role": "system", "content": "Be brief."},
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "sunny, 21 C"},
        {"role": "assistant", "content": "It is sunny."},
        {"role": "user", "content": "And 'Rome'?"},
    ]
    for tools in (None, TOOLS):
        for msgs in (agent_loop, MESSAGES):
            text = tok.apply_chat_template(msgs, tools=tools, add_generation_prompt=True, tokenize=False)
            assert text == format_chat(msgs, add_generation_prompt=True, tools=tools)
    assert json.dumps(TOOLS[0], ensure_ascii=False) in text and text.endswith("<|assistant|>\n")
    # no tools: the prompt is what it always was
    plain = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert plain == format_chat(MESSAGES, add_generation_prompt=True) and TOOL_CALL_START not in plain


def test_worker_renders_tools_and_an_agent_loop_from_openai_messages(tiny_model):
    tok = tiny_model.tokenizer
    loop = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1, "units": "C"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "sunny"},
    ]
    ids = tokenize(request(messages=loop), tok)
    text = tok.decode(ids)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 1, "units": "C"}}' in text
    assert "<tool_response>\nsunny\n</tool_response>" in text and '"name": "get_time"' in text
    # tool_choice "none": the tools are not rendered
    assert TOOL_CALL_START not in tok.decode(tokenize(request(tool_choice="none"), tok))
    with pytest.raises(ValueError, match="only assistant messages carry tool_calls"):
        request(messages=[{"role": "user", "content": "x", "tool_calls": []}])


# -- the output split ---------------------------------------------------------------------------------

def split(tok, req, text: str):
    """Feed ``text``'s tokens through the job's output stream: (answer, reasoning, calls)."""
    stream = chat_stream(tok, req, [])
    answer = "".join(stream.add(t) for t in tok.encode(text, add_special_tokens=False)) + stream.finish()
    return answer, stream.reasoning, stream.calls


def test_chat_output_splits_answer_reasoning_and_calls(tiny_model):
    tok = tiny_model.tokenizer
    call = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET", "utc": false}}\n</tool_call>'
    text = f"<think>Let me see.</think>\n\nSure. {call} and <tool_call>\nnot json\n</tool_call> done"
    answer, reasoning, calls = split(tok, request(), text)
    assert reasoning == "Let me see."
    assert calls == [{"name": "get_time", "arguments": '{"zone": "CET", "utc": false}'}]
    # a call that does not parse stays in the answer as written: nothing is lost
    assert answer == "\n\nSure.  and <tool_call>\nnot json\n</tool_call> done"
    # no tools (or tool_choice "none"): tool-call markup is text; thinking is still split
    for req in (request(tools=None), request(tool_choice="none")):
        answer, reasoning, calls = split(tok, req, text)
        assert calls == [] and call in answer and reasoning == "Let me see."
    # a raw prompt job: its text exactly as decoded
    raw = GenerateRequest(model="tiny", prompt="x")
    assert split(tok, raw, text) == (text, "", [])
    # an unterminated call at the end: parsed when whole, else kept as text
    assert split(tok, request(), call[: -len(TOOL_CALL_END)])[2] == calls_of(call)
    assert split(tok, request(), "<tool_call>\n{\"name\": \"get_ti")[0] == "<tool_call>\n{\"name\": \"get_ti"


def calls_of(call_text: str) -> list[dict]:
    inner = json.loads(call_text.split("\n")[1])
    return [{"name": inner["name"], "arguments": json.dumps(inner["arguments"])}]


def test_deltas_resume_exactly_after_a_crash_at_any_token(tiny_model):
    """A job streamed in one run, and the same job cut after every k tokens and taken over from its
    durable record (read_published): the subscriber's copy of answer, reasoning and calls is the same."""
    tok = tiny_model.tokenizer
    text = ("<think>Plan: call it.</think>Here. <tool_call>\n{\"name\": \"get_time\", \"arguments\": "
            "{\"zone\": \"UTC\", \"utc\": true}}\n</tool_call> then <tool_call>\n{\"name\": \"get_weather\", "
            "\"arguments\": {\"city\": \"Rome\", \"days\": 2, \"units\": \"C\"}}\n</tool_call> bye")
    ids = tok.encode(text, add_special_tokens=False)
    req = request()
    whole = run_job(tok, req, ids, [])
    assert whole[2] and whole[1] == "Plan: call it." and len(whole[3]) == 2
    assert streamed_calls(whole[5]) == whole[3]
    for cut in range(1, len(ids)):
        first = run_job(tok, req, ids[:cut], [], finish=False)
        again = run_job(tok, req, ids, first[4])
        merged = (first[0] + again[0], first[1] + again[1], None, first[3] + again[3])
        assert merged[0] == whole[0] and merged[1] == whole[1] and merged[3] == whole[3], cut
        # the gateway's stream of both runs: each call's streamed arguments add up to it, once
        assert streamed_calls(first[5] + again[5]) == whole[3], cut


def streamed_calls(deltas) -> list[dict]:
    """The calls as a client reassembles the gateway's chunks (the openai library's rule: a call's
    first entry names it, the arguments of its entries are joined)."""
    from mlxq.producer.openai_api import ChatDeltas

    chat, calls, pieces = ChatDeltas(), {}, {}
    for d in deltas:
        if d.partial_call_name is not None:  # mlxq's own deltas: each piece of arguments once, in order
            k = d.tool_call_index + len(d.tool_calls or ())
            assert d.partial_args and d.partial_args_offset == len(pieces.get(k, ""))
            pieces[k] = pieces.get(k, "") + d.partial_args
        for entry in chat.delta(d).get("tool_calls", ()):
            k, fn = entry["index"], entry["function"]
            if "id" in entry:  # a call's first entry, once, in order
                assert k == len(calls)
                calls[k] = {"id": entry["id"], "type": "function", "function": {"name": fn["name"], "arguments": ""}}
            calls[k]["function"]["arguments"] += fn.get("arguments", "")
    assert all(calls[k]["function"]["arguments"] == args for k, args in pieces.items())
    return [calls[k] for k in sorted(calls)]


def run_job(tok, req, ids, record, finish=True):
    """Stream ``ids`` as the worker does (resuming from ``record``, the wire deltas so far): (answer,
    reasoning, finish, calls, record) of the deltas this run published."""
    published = read_published([(f"{i + 1}-0".encode(), {b"d": w}) for i, w in enumerate(record)])
    job = ActiveJob(id="ab" * 16, request=req, attempt=2 if record else 1, owner="w:1", tier="normal", score=0,
                    queued_at=0, started_at=0, prompt=[], seed=1, text=chat_stream(tok, req, []), clock_offset=0)
    resume_from(job, published)
    from mlxq.shared.schemas import Delta

    out, wire = [], list(record)
    for t in ids[len(job.tokens):]:
        job.tokens.append(t)
        out.append(job.emit(job.text.add(t), [t]))
    if finish:
        out.append(job.emit(job.text.finish(), [], "stop"))
    wire += [job.wire(d) for d in out]
    calls = [c.model_dump() for d in out for c in d.tool_calls or ()]
    reason = out[-1].finish_reason if out else None
    assert all(isinstance(Delta.from_wire(json_round(d.to_wire())), Delta) for d in out)
    return "".join(d.text for d in out), "".join(d.reasoning for d in out), reason, calls, wire, out


def resume_from(job, published: Published) -> None:
    """What start_job does with a durable record."""
    if not published.seq:
        return
    job.tokens = list(published.tokens)
    for t in job.tokens:
        job.full_text += job.text.add(t)
    job.sent_chars, job.seq = published.chars, published.seq
    job.sent_reasoning, job.sent_calls = published.reasoning_chars, published.calls
    job.sent_args = published.args_chars


def json_round(d: dict) -> dict:
    return json.loads(json.dumps(d))


def test_finish_reason_is_tool_calls_and_ids_are_stable(tiny_model):
    tok = tiny_model.tokenizer
    text = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC", "utc": true}}\n</tool_call>'
    ids = tok.encode(text, add_special_tokens=False)
    runs = [run_job(tok, request(), ids, []) for _ in range(2)]
    assert runs[0][2] == "tool_calls" and runs[0][0] == ""
    assert runs[0][3] == runs[1][3] and runs[0][3][0]["id"].startswith("call_")
    check_calls(runs[0][3])


# -- the grammar ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ll_tokenizer(tiny_model):
    return llguidance.hf.from_tokenizer(tiny_model.tokenizer._tokenizer)


@pytest.mark.parametrize("choice,parallel", [("required", True), ("required", False),
                                             ({"type": "function", "function": {"name": "get_time"}}, True)])
def test_required_and_named_calls_follow_the_schemas_whatever_the_model_picks(tiny_model, ll_tokenizer, choice, parallel):
    tok = tiny_model.tokenizer
    req = request(tool_choice=choice, parallel_tool_calls=parallel)
    grammar = tool_grammar(req, chat_format(tok))
    names = ("get_time",) if isinstance(choice, dict) else tuple(SCHEMAS)
    think_end = chat_format(tok).think_end_ids[0]  # a thought may come first: let it end
    for seed in range(6):
        ids, ended = sample(ll_tokenizer, grammar, seed, prefer=[think_end])
        assert ended
        answer, _, calls = split(tok, req, tok.decode(ids))
        assert answer.strip() == ""
        check_calls(calls, names)
        assert len(calls) == 1 or parallel and not isinstance(choice, dict)


def test_auto_is_free_text_until_a_call_starts_then_the_call_is_constrained(tiny_model, ll_tokenizer):
    tok = tiny_model.tokenizer
    fmt = chat_format(tok)
    start = fmt.tool_call_start_ids[0]
    for parallel in (True, False):
        req = request(parallel_tool_calls=parallel)
        grammar = tool_grammar(req, fmt)
        n_calls = 0
        for seed in range(10):
            ids, _ = sample(ll_tokenizer, grammar, seed, prefer=[start], max_tokens=250)
            answer, _, calls = split(tok, req, tok.decode(ids))  # a call cut by the budget stays text
            if calls:
                check_calls(calls)
            assert len(calls) <= 1 or parallel
            n_calls += len(calls)
        assert n_calls  # the preferred start token opened calls, and they parsed


def test_auto_calls_with_markers_added_as_tokens_not_flagged_special(tiny_model, tiny_model_dir):
    """Qwen2.5's and Qwen3's ``<tool_call>`` is a token added to the vocabulary with ``special: false``.
    llguidance treats every added token as special, so the marker is a token in the grammar, never
    text: with it as text, tool_choice "auto" allowed neither the token nor the text, and the model
    could never call. Here the tiny tokenizer with two such markers added: "auto" lets the start
    token open a call, and the calls drawn parse and follow their schemas."""
    from tokenizers import AddedToken, Tokenizer
    from transformers import PreTrainedTokenizerFast

    from mlxq.shared.constraints import ModelFormat

    t = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    t.add_tokens([AddedToken(x, special=False, normalized=False) for x in ("<tc>", "</tc>")])
    eos = tiny_model.tokenizer.eos_token
    hf = PreTrainedTokenizerFast(tokenizer_object=t, eos_token=eos)
    start, end = hf.convert_tokens_to_ids("<tc>"), hf.convert_tokens_to_ids("</tc>")
    assert start not in hf.all_special_ids
    wrapper = types.SimpleNamespace(_tokenizer=hf, tool_call_start="<tc>", tool_call_end="</tc>",
                                    tool_parser=tiny_model.tokenizer.tool_parser, tool_call_start_tokens=[start],
                                    tool_call_end_tokens=[end])  # as mlx-lm's TokenizerWrapper holds it
    fmt = ModelFormat.from_tokenizer(wrapper)
    assert fmt.tool_markers_special and fmt.tool_call_start_ids == (start,) and not fmt.think_start
    ll_tok = llguidance.hf.from_tokenizer(hf, eos_token=[hf.eos_token_id])
    grammar = tool_grammar(request(parallel_tool_calls=False), fmt)
    calls = []
    for seed in range(8):
        ids, _ = sample(ll_tok, grammar, seed, prefer=[start], eos=hf.eos_token_id, max_tokens=250)
        if start in ids and end in ids:
            body = hf.decode(ids[ids.index(start) + 1:ids.index(end)])
            calls.append(json.loads(body))
    assert calls  # before: the start token was never allowed
    for call in calls:
        jsonschema.validate(call["arguments"], SCHEMAS[call["name"]])


# a Hermes-style call format whose markers are plain text (several tokens each in the tiny tokenizer)
TEXT_START, TEXT_END = "<tc>", "</tc>"
NAMED_TIME = {"type": "function", "function": {"name": "get_time"}}


@pytest.fixture(scope="module")
def text_markers(tiny_model, tiny_model_dir):
    """(hf tokenizer, llguidance tokenizer, format) of the tiny tokenizer with text call markers."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_file=str(tiny_model_dir / "tokenizer.json"),
                                 eos_token=tiny_model.tokenizer.eos_token)
    wrapper = types.SimpleNamespace(_tokenizer=hf, tool_call_start=TEXT_START, tool_call_end=TEXT_END,
                                    tool_parser=tiny_model.tokenizer.tool_parser,
                                    tool_call_start_tokens=hf.encode(TEXT_START, add_special_tokens=False),
                                    tool_call_end_tokens=hf.encode(TEXT_END, add_special_tokens=False))
    fmt = ModelFormat.from_tokenizer(wrapper)
    assert len(fmt.tool_call_start_ids) > 1 and not fmt.tool_markers_special
    return hf, llguidance.hf.from_tokenizer(hf, eos_token=[hf.eos_token_id]), fmt


def text_split(hf, fmt, req, ids):
    """(answer, reasoning, calls) of ``ids`` through a chat stream in format ``fmt``."""
    from mlx_lm.tool_parsers import json_tools

    stream = ChatStream(TextStream.for_tokenizer(types.SimpleNamespace(_tokenizer=hf)), fmt, tools=True, parse=json_tools.parse_tool_call,
                        tool_defs=TOOLS)
    answer = "".join(stream.add(t) for t in ids) + stream.finish()
    return answer, stream.reasoning, stream.calls


def accepts(ll_tok, grammar: str, ids) -> bool:
    m = llguidance.LLMatcher(ll_tok, grammar, log_level=0)
    return m.consume_tokens(list(ids)) and not m.is_error()


@pytest.mark.parametrize("choice", ["auto", "required", NAMED_TIME])
def test_one_call_at_most_without_parallel_calls_when_the_markers_are_text(text_markers, choice):
    """parallel_tool_calls false holds for a format whose call marker is text: with "auto", the text
    after a call could spell a second one, which the parser took as a call all the same."""
    hf, ll_tok, fmt = text_markers
    req = request(tool_choice=choice, parallel_tool_calls=False)
    grammar = tool_grammar(req, fmt)
    one = f'{TEXT_START}\n{{"name": "get_time", "arguments": {{"zone": "UTC", "utc": true}}}}\n{TEXT_END}'
    assert accepts(ll_tok, grammar, hf.encode(one))
    for two in (one + one, one + "\n" + one, one + " and " + one, one + " " + TEXT_START):
        assert not accepts(ll_tok, grammar, hf.encode(two)), two
    # whatever the model draws after a call (the marker's first token preferred): one call, parsed
    start = fmt.tool_call_start_ids
    for seed in range(8):
        ids, _ = sample(ll_tok, grammar, seed, prefer=start[:1], eos=hf.eos_token_id, max_tokens=200,
                        prefix=hf.encode(one))
        answer, _, calls = text_split(hf, fmt, req, ids)
        check_calls(calls)
        assert len(calls) == 1 and TEXT_START not in answer
    if choice == "auto":  # parallel calls still allowed when asked for
        assert accepts(ll_tok, tool_grammar(request(), fmt), hf.encode(one + " and " + one))


NOTE = {"type": "function", "function": {"name": "note", "parameters": {
    "type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"], "additionalProperties": False}}}
MARKED_TEXTS = [f"a {TOOL_CALL_END} b", f"{TEXT_END}", f'\\"{TOOL_CALL_END}{TEXT_END}"', "\\", f"{THINK_END} {TOOL_CALL_START}",
                f'x" }}\n{TEXT_END}\n{TOOL_CALL_END}']


@pytest.mark.parametrize("markers", ["special", "text"])
def test_a_string_argument_may_hold_the_end_marker(tiny_model, ll_tokenizer, text_markers, markers):
    """A call the grammar allows parses back exactly, whatever its string arguments hold: the call ended
    at the first text that spelled its end marker, inside a JSON string, and came back cut (as text)."""
    if markers == "special":
        tok = tiny_model.tokenizer
        hf, ll_tok, fmt = tok._tokenizer, ll_tokenizer, chat_format(tok)
        start, end = list(fmt.tool_call_start_ids), list(fmt.tool_call_end_ids)
    else:
        hf, ll_tok, fmt = text_markers
        start, end = hf.encode(TEXT_START), hf.encode(TEXT_END)
    req = request(tools=[NOTE], tool_choice="required", parallel_tool_calls=False)
    grammar = tool_grammar(req, fmt)
    for text in MARKED_TEXTS:
        args = json.dumps({"text": text}, ensure_ascii=False)
        # the markers inside the string spelled by plain tokens, as the grammar lets a model write them
        body = hf.encode('\n{"name": "note", "arguments": ' + args + '}\n', split_special_tokens=True)
        ids = start + body + end
        m = llguidance.LLMatcher(ll_tok, grammar, log_level=0)
        assert m.consume_tokens(ids) and m.is_accepting(), (text, m.get_error())
        answer, _, calls = text_split(hf, fmt, req, ids)
        assert calls == [{"name": "note", "arguments": args}] and answer == "", text


THINK_TEXT_START, THINK_TEXT_END = "<th>", "</th>"
LABEL = {"type": "json_schema", "json_schema": {"name": "label", "strict": True, "schema": {
    "type": "object", "properties": {"label": {"type": "string", "enum": ["spam", "ham"]}}, "required": ["label"]}}}


@pytest.fixture(scope="module")
def text_thinking(tiny_model, text_markers):
    """A tokenizer wrapper (as mlx-lm's holds it) and its format: thinking and call markers all text."""
    hf, ll_tok, _ = text_markers
    ids = {m: hf.encode(m, add_special_tokens=False) for m in (TEXT_START, TEXT_END, THINK_TEXT_START, THINK_TEXT_END)}
    wrapper = types.SimpleNamespace(
        _tokenizer=hf, has_thinking=True, think_start=THINK_TEXT_START, think_end=THINK_TEXT_END,
        think_start_tokens=ids[THINK_TEXT_START], think_end_tokens=ids[THINK_TEXT_END], tool_call_start=TEXT_START,
        tool_call_end=TEXT_END, tool_call_start_tokens=ids[TEXT_START], tool_call_end_tokens=ids[TEXT_END],
        tool_parser=tiny_model.tokenizer.tool_parser)
    fmt = chat_format(wrapper)
    assert len(fmt.think_end_ids) > 1 and fmt.tool_parser == "json_tools"
    return wrapper, hf, ll_tok, fmt


def test_a_constraint_after_a_thought_whose_markers_are_text(text_thinking):
    """Reasoning markers spelled by several tokens: the thought ends where its text first holds the end
    marker, and the answer after it follows the response_format. The thought's free text ran past the
    marker before, so the answer was never constrained (and could not end: EOS was never allowed)."""
    from mlxq.shared.constraints import grammar_for

    wrapper, hf, ll_tok, fmt = text_thinking
    req = GenerateRequest.model_validate({"model": "tiny", "messages": MESSAGES, "response_format": LABEL})
    grammar = grammar_for(req, fmt)
    schema = LABEL["json_schema"]["schema"]
    for seed in range(6):
        ids, ended = sample(ll_tok, grammar, seed, eos=hf.eos_token_id, max_tokens=100,
                            prefix=hf.encode(f"{THINK_TEXT_START}a {{ plan{THINK_TEXT_END}"))
        assert ended
        stream = ChatStream(TextStream.for_tokenizer(wrapper), fmt)
        answer = "".join(stream.add(t) for t in ids) + stream.finish()
        assert stream.reasoning == "a { plan"
        jsonschema.validate(json.loads(answer), schema)
    # the first end marker ends the thought: more thought after it is refused
    assert not accepts(ll_tok, grammar, hf.encode(f'{THINK_TEXT_START}a{THINK_TEXT_END} b{THINK_TEXT_END}{{"label":"ham"}}'))
    # a prompt that opened the thought (found in its text): the output starts as thought
    opened = hf.encode(f"<|user|>hi\n<|assistant|>\n{THINK_TEXT_START}\n")
    closed = hf.encode(f"<|user|>hi\n<|assistant|>\n{THINK_TEXT_START}\nok{THINK_TEXT_END}\n")
    assert prompt_in_thinking(opened, fmt, wrapper) and not prompt_in_thinking(closed, fmt, wrapper)
    assert not prompt_in_thinking(hf.encode("hi"), fmt, wrapper)
    in_thought = job_grammar(req, opened, wrapper)
    assert accepts(ll_tok, in_thought, hf.encode(f'more{THINK_TEXT_END}{{"label":"spam"}}'))
    m = llguidance.LLMatcher(ll_tok, in_thought, log_level=0)
    assert m.consume_tokens(hf.encode('{"label":"spam"}')) and not m.is_accepting()  # still the thought
    assert job_grammar(req, closed, wrapper) == grammar


@pytest.mark.parametrize("choice", ["auto", "required"])
def test_tool_calls_after_a_thought_whose_markers_are_text(text_thinking, choice):
    """Tools, with thinking and call markers all text: a thought comes first and ends at its marker;
    it may not hold a call (the output's split would parse it, unconstrained: a second call with
    parallel_tool_calls false)."""
    wrapper, hf, ll_tok, fmt = text_thinking
    req = request(tool_choice=choice, parallel_tool_calls=False)
    grammar = tool_grammar(req, fmt)
    call = f'{TEXT_START}\n{{"name": "get_time", "arguments": {{"zone": "UTC", "utc": true}}}}\n{TEXT_END}'
    thought = f"{THINK_TEXT_START}plan{THINK_TEXT_END}"
    assert accepts(ll_tok, grammar, hf.encode(thought + call))
    assert not accepts(ll_tok, grammar, hf.encode(f"{THINK_TEXT_START}plan {call}{THINK_TEXT_END}{call}"))
    for seed in range(6):
        ids, _ = sample(ll_tok, grammar, seed, eos=hf.eos_token_id, max_tokens=150, prefix=hf.encode(thought + call))
        stream = ChatStream(TextStream.for_tokenizer(wrapper), fmt, tools=True, parse=wrapper.tool_parser,
                            tool_defs=TOOLS)
        "".join(stream.add(t) for t in ids) + stream.finish()
        assert stream.reasoning == "plan" and len(stream.calls) == 1
        check_calls(stream.calls)


def test_thinking_comes_first_and_is_free(tiny_model, ll_tokenizer):
    tok = tiny_model.tokenizer
    fmt = chat_format(tok)
    req = request(tool_choice="required", parallel_tool_calls=False)
    grammar = tool_grammar(req, fmt)
    think_start, think_end = fmt.think_start_ids[0], fmt.think_end_ids[0]
    seen_thought = False
    for seed in range(12):
        ids, ended = sample(ll_tokenizer, grammar, seed, prefer=[think_start, think_end] if seed % 2 else [])
        if not ended:
            continue  # a thought that never ended within the budget
        answer, reasoning, calls = split(tok, req, tok.decode(ids))
        check_calls(calls)
        seen_thought |= bool(reasoning)
    assert seen_thought
    # a prompt that opened the thinking block: the output starts as thought
    open_fmt = dataclasses.replace(fmt, in_thinking=True)
    ids, ended = sample(ll_tokenizer, tool_grammar(req, open_fmt), 3, prefer=[think_end])
    assert ended and ids[0] != think_start and think_end in ids


def test_bad_tools_are_refused_before_queueing(tiny_model):
    with pytest.raises(ValueError, match="'nope', which is not in tools"):
        request(tool_choice={"type": "function", "function": {"name": "nope"}})
    with pytest.raises(ValueError, match="needs tools"):
        request(tools=None, tool_choice="required")
    with pytest.raises(ValueError, match="duplicate function name"):
        request(tools=TOOLS + TOOLS[:1])
    with pytest.raises(ValueError, match="'f'.*object"):
        request(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}])
    with pytest.raises(ValueError, match="'f'.*not supported"):
        request(tools=[{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"a": {"type": "strin"}}}}}])
    # a family whose calls cannot be enforced: required and named refused naming it, auto parses only
    fmt = dataclasses.replace(chat_format(tiny_model.tokenizer), tool_parser="pythonic")
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        with pytest.raises(ToolError, match="pythonic"):
            check_tools(request(tool_choice=choice), fmt)
    assert tool_grammar(request(), fmt) is None
    # ... and with auto, nothing could hold the answer to a response_format or to one call
    for extra in ({"response_format": {"type": "json_object"}}, {"parallel_tool_calls": False}):
        with pytest.raises(ToolError, match="pythonic"):
            check_tools(request(**extra), fmt)
        with pytest.raises(ToolError, match="pythonic"):
            tool_grammar(request(**extra), fmt)
        assert tool_grammar(request(**extra), chat_format(tiny_model.tokenizer)) is not None  # enforced there
    assert tool_grammar(request(tool_choice="none"), chat_format(tiny_model.tokenizer)) is None
    # a template with no call format mlx-lm knows takes no tools, auto included (its calls would come
    # back as text); "none" stays allowed
    bare = dataclasses.replace(chat_format(tiny_model.tokenizer), tool_parser=None)
    for choice in ("auto", "required", {"type": "function", "function": {"name": "get_time"}}):
        with pytest.raises(ToolError, match="no tool-call format mlx-lm knows"):
            check_tools(request(tool_choice=choice), bare)
        with pytest.raises(ToolError, match="no tool-call format mlx-lm knows"):
            tool_grammar(request(tool_choice=choice), bare)
    check_tools(request(tool_choice="none"), bare)
    # the format a worker publishes reads back the same (msgpack turns tuples into lists)
    info = {"chat_format": json.loads(json.dumps(format_info(chat_format(tiny_model.tokenizer))))}
    assert format_from_info(info) == chat_format(tiny_model.tokenizer)
    assert format_from_info({}) is None and format_from_info({"chat_format": {}}) == ModelFormat()


# -- end to end through a worker ------------------------------------------------------------------------

def test_tool_jobs_end_to_end_and_the_worker_keeps_serving(tiny_model, redis_url):
    tok = tiny_model.tokenizer
    start = tok.get_vocab()[TOOL_CALL_START]
    settings = fast_settings(redis_url)
    client = Client(redis_url, model="tiny", settings=settings)
    # a constrained answer may begin with a free thought; the untrained <think> is kept out by a bias
    # (whether it outranks a call's first token is up to the tiny model's random weights)
    no_thought = {tok.get_vocab()[THINK_START]: -100.0}
    with running_worker(tiny_model, redis_url, settings, max_batch=8):
        jobs = {
            # one call (parallel calls: how many is the model's choice, and a random-ish one may not stop)
            "required": client.submit(messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=200,
                                      parallel_tool_calls=False, logit_bias=no_thought),
            "named": client.submit(messages=MESSAGES, tools=TOOLS, max_tokens=200, temperature=0.8, seed=5,
                                   tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                   logit_bias=no_thought),
            # auto: the bias makes the model start a call, which the lazy grammar then constrains
            "auto": client.submit(messages=MESSAGES, tools=TOOLS, parallel_tool_calls=False, max_tokens=200,
                                  logit_bias={**no_thought, start: 100.0}),
            "free": client.submit(messages=MESSAGES, max_tokens=12),
        }
        results = {k: j.result(timeout=300) for k, j in jobs.items()}
        # a Client's stream carries the calls too (here replayed from the durable record)
        streamed = [d for d in jobs["named"].stream(timeout=120)]
        # what a buggy or hostile producer could queue: refused by the worker with a clear error
        bad = {"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": TOOLS}
        bad_ids = [push_raw(client, {"messages": MESSAGES, **bad}),
                   push_raw(client, {"messages": MESSAGES, "tools": [{"type": "function", "function": {
                       "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "nope"}}}}}]})]
        refused = [client.job(i).result(timeout=120) for i in bad_ids]
        after = client.submit(messages=MESSAGES, max_tokens=4).result(timeout=120)
    for key in ("required", "named", "auto"):
        res = results[key]
        assert res.finish_reason == "tool_calls", (key, res)
        check_calls([c.model_dump() for c in res.tool_calls], ("get_weather",) if key == "named" else tuple(SCHEMAS))
        assert TOOL_CALL_START not in res.text
    assert len(results["auto"].tool_calls) == 1 and results["auto"].token_ids[0] == start
    assert [c for d in streamed for c in d.tool_calls or ()] == results["named"].tool_calls
    assert [i for d in streamed for i in d.token_ids] == results["named"].token_ids
    assert streamed[-1].finish_reason == "tool_calls"
    assert results["free"].tool_calls is None and results["free"].finish_reason in ("stop", "length")
    assert [r.finish_reason for r in refused] == ["error", "error"]
    assert "'nope'" in refused[0].error and "'f'" in refused[1].error
    assert all(r.error_code == "invalid_request" for r in refused)
    assert after.finish_reason in ("stop", "length")  # the worker kept serving


def push_raw(client, fields: dict) -> str:
    """Queue a request as a producer that skips validation would (straight into Redis)."""
    from mlxq.shared import codec
    from mlxq.shared.keys import ModelKeys
    from mlxq.shared.protocol import Queue
    from mlxq.shared.schemas import new_job_id

    job_id = new_job_id()
    raw = {"id": job_id, "model": "tiny", "max_tokens": 8, "source": "client", **fields}
    Queue(client.redis, ModelKeys("tiny"), client.settings).enqueue(job_id, codec.pack(raw), global_redis=client.redis)
    return job_id


def test_a_chat_template_that_renders_nothing_is_refused_for_that_job(tiny_model):
    """A template (user code) that renders the messages as no tokens: the job is refused with a
    clear error; the empty prompt reached the engine's add before, which raised on the worker's
    MLX thread and stopped the worker."""
    from mlxq.worker.jobs import JobError

    class Silent:
        chat_template = "{# renders nothing #}"

        def __getattr__(self, name):
            return getattr(tiny_model.tokenizer, name)

        def apply_chat_template(self, *a, **kw):
            return []

    with pytest.raises(JobError, match="empty prompt"):
        tokenize(request(messages=[{"role": "user", "content": "hi"}]), Silent())


def test_token_ids_past_the_models_embedding_are_refused(tiny_model):
    """A tokenizer with more ids than the model has embedding rows (tokens added without a resize):
    prompt_tokens and logit_bias are held to the fewer, where an id in between indexed the embedding
    out of bounds."""
    from mlxq.worker.jobs import JobError, check_token_ids, token_limit

    tok = tiny_model.tokenizer
    rows = token_limit(tok) - 10
    assert token_limit(tok, rows) == rows and token_limit(tok, None) == rows + 10
    req = GenerateRequest.model_validate({"model": "tiny", "prompt_tokens": [1, rows]})
    assert tokenize(req, tok) == [1, rows]
    with pytest.raises(JobError, match="outside the vocabulary"):
        tokenize(req, tok, rows)
    bias = GenerateRequest.model_validate({"model": "tiny", "prompt": "hi", "logit_bias": {str(rows): 1}})
    check_token_ids(bias, tok)
    with pytest.raises(JobError, match="outside the vocabulary"):
        check_token_ids(bias, tok, rows)

