"""Tool calls with any chat model: templates with no tool slot (ChatML as SmolLM2's; one that refuses
a system role and insists on alternating roles, as Gemma's), one that renders tools in a format
mlx-lm cannot parse, and a model with no template at all.  mlxq describes the tools itself, holds
the model to its own call format (Hermes's ``<tool_call>`` JSON blocks, markers as text) and parses
the calls back.  Variants of the tiny model (its template has a slot) are built by copying its
directory with another template; the tiny model's text follows the BLAS, so only properties of the
output are asserted."""

from __future__ import annotations

import json
import shutil

import jsonschema
import llguidance
import llguidance.hf
import pytest

from mlxq import Client
from mlxq.devkit.make_model import THINK_START, TOOL_CALL_END, TOOL_CALL_START
from mlxq.shared.grammars import grammar_for
from mlxq.shared.schemas import GenerateRequest
from mlxq.shared.tools import ToolError, check_format, check_tools, format_from_info, tool_grammar
from mlxq.worker.jobs import chat_stream, tokenize
from mlxq.worker.textstream import chat_format
from mlxq.worker.toolprompt import serving_format, traits
from toolcallkit import MESSAGES, SCHEMAS, TOOLS, check_calls, sample
from workerkit import fast_settings, running_worker

# SmolLM2's ChatML template (its default system turn), with the tiny model's role tokens
CHATML = ("{% for message in messages %}"
          "{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|system|>\\nYou are a helpful AI assistant.<|end|>\\n' }}{% endif %}"
          "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}")
# Gemma's rules: no system role, user and assistant turns alternate, starting with the user
GEMMA = ("{{ bos_token }}"
         "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
         "{% for message in messages %}"
         "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
         "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
         "{{ '<|' + message['role'] + '|>\\n' + message['content'] | trim + '<|end|>\\n' }}"
         "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}")
# renders tools in its own way (as Llama 3.1's does), in no format mlx-lm has a parser for
FOREIGN = ("{% if tools %}{{ '<|system|>\\nFunctions: ' }}{% for t in tools %}{{ t | tojson }}{% endfor %}"
           "{{ '<|end|>\\n' }}{% endif %}"
           "{% for message in messages %}{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
           "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}")
VARIANTS = {"chatml": CHATML, "gemma": GEMMA, "plain": None, "foreign": FOREIGN}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
CHOICES = {"named": NAMED, "required": "required", "auto": "auto"}
LOOP = [
    {"role": "system", "content": "Be brief."},
    *MESSAGES,
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1, "units": "C"}'}},
        {"id": "call_2", "type": "function",
         "function": {"name": "get_time", "arguments": '{"zone": "CET", "utc": false}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "sunny, 21 C"},
    {"role": "tool", "tool_call_id": "call_2", "name": "get_time", "content": "14:05"},
]
CALLS_TEXT = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 1, "units": "C"}}\n'
              '</tool_call>\n'
              '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET", "utc": false}}\n</tool_call>')
RESULTS_TEXT = "<tool_response>\nsunny, 21 C\n</tool_response>\n<tool_response>\n14:05\n</tool_response>"


def variant_dir(src, dst, template, text_markers: bool):
    """A copy of the tiny model's directory with ``template`` (None: no chat template); with
    ``text_markers``, ``<tool_call>``/``</tool_call>`` are no added tokens (plain text, several
    tokens each, as in SmolLM2's vocabulary)."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.lock", "mlxq_build.json"))
    config = json.loads((dst / "tokenizer_config.json").read_text())
    config.pop("chat_template")
    if template is not None:
        config["chat_template"] = template
    if text_markers:
        markers = (TOOL_CALL_START, TOOL_CALL_END)
        tok = json.loads((dst / "tokenizer.json").read_text())
        tok["added_tokens"] = [a for a in tok["added_tokens"] if a["content"] not in markers]
        (dst / "tokenizer.json").write_text(json.dumps(tok))
        config["added_tokens_decoder"] = {k: v for k, v in config["added_tokens_decoder"].items()
                                          if v["content"] not in markers}
        special = json.loads((dst / "special_tokens_map.json").read_text())
        for cfg in (config, special):
            cfg["additional_special_tokens"] = [t for t in cfg["additional_special_tokens"] if t not in markers]
        (dst / "special_tokens_map.json").write_text(json.dumps(special))
    (dst / "tokenizer_config.json").write_text(json.dumps(config))
    return dst


@pytest.fixture(scope="module")
def variants(tiny_model_dir, tmp_path_factory):
    """name -> LoadedModel of each variant (served under its own queue name)."""
    from mlxq.worker.model import load_model

    root = tmp_path_factory.mktemp("variants")
    return {name: load_model(str(variant_dir(tiny_model_dir, root / name, template, name == "chatml")),
                             name=f"tiny-{name}")
            for name, template in VARIANTS.items()}


def request(model="tiny", **kw) -> GenerateRequest:
    return GenerateRequest.model_validate({"model": model, "messages": MESSAGES, "tools": TOOLS, **kw})


def tool_json(tool: dict) -> str:
    fn = tool["function"]
    return json.dumps({"name": fn["name"], "description": fn["description"], "parameters": fn["parameters"]},
                      ensure_ascii=False)


def test_the_template_is_probed_and_the_format_published(tiny_model, variants):
    # the tiny template renders tools in Hermes's format: served as it is
    assert serving_format(tiny_model.tokenizer) == chat_format(tiny_model.tokenizer)
    assert traits(tiny_model.tokenizer).renders_tools and not chat_format(tiny_model.tokenizer).mlxq_tools
    found = {name: traits(v.tokenizer) for name, v in variants.items()}
    assert [found[n].renders_tools for n in VARIANTS] == [False, False, False, True]
    assert not found["gemma"].system_role and not found["gemma"].repeated_roles
    assert found["chatml"].system_role and found["chatml"].repeated_roles
    for name, v in variants.items():
        tok = v.tokenizer
        assert chat_format(tok).tool_parser is None, name  # mlx-lm knows no call format for any of them
        fmt = serving_format(tok)
        assert fmt.mlxq_tools and fmt.tool_parser == "json_tools", name
        assert (fmt.tool_call_start, fmt.tool_call_end) == (TOOL_CALL_START, TOOL_CALL_END)
        assert fmt.think_start == chat_format(tok).think_start  # reasoning markers kept
        # what a gateway reads from the model's info lets every choice through, before queueing
        published = format_from_info(json.loads(json.dumps(v.info())))
        assert published == fmt
        for choice in CHOICES.values():
            for extra in ({}, {"parallel_tool_calls": False}, {"response_format": {"type": "json_object"}}):
                check_format(request(tool_choice=choice, **extra), published)
    # SmolLM2-like: the markers are plain text (several tokens); Gemma-like: one added token each
    assert len(serving_format(variants["chatml"].tokenizer).tool_call_start_ids) > 1
    assert not serving_format(variants["chatml"].tokenizer).tool_markers_special
    assert serving_format(variants["gemma"].tokenizer).tool_markers_special


@pytest.mark.parametrize("name", list(VARIANTS))
def test_the_prompt_describes_the_tools_and_the_call_format(variants, name):
    tok = variants[name].tokenizer
    for choice in CHOICES.values():
        for parallel in (True, False):
            for msgs in (MESSAGES, [{"role": "system", "content": "Be brief."}, *MESSAGES]):
                req = request(messages=msgs, tool_choice=choice, parallel_tool_calls=parallel)
                text = tok.decode(tokenize(req, tok))
                assert all(tool_json(t) in text for t in TOOLS), text
                assert ('<tool_call>\n{"name": "<function name>", "arguments": <the arguments, a JSON object>}\n'
                        "</tool_call>") in text
                assert "Functions:" not in text  # a template's own tool rendering is not used
                assert ("Call the function get_weather now." in text) == (choice == NAMED)
                assert ("Make one call at most." in text) == (choice == "auto" and not parallel)
                if len(msgs) > 1:  # the caller's system text comes first, then the tools
                    assert text.index("Be brief.") < text.index("You can call these functions")
                if name == "gemma":  # no system role: the tools head the first user turn
                    assert "<|system|>" not in text
                    head = "<|user|>\n" + ("Be brief.\n\n" if len(msgs) > 1 else "") + "You can call"
                    assert text.index(head) < text.index("What is the weather")
                elif name == "plain":
                    assert text.startswith("ASSISTANT's RULE: ") and text.endswith("ASSISTANT:")
                else:
                    assert "<|system|>\n" + ("Be brief.\n\n" if len(msgs) > 1 else "") + "You can call" in text
    # tool_choice "none": the tools are not described
    assert "You can call" not in tok.decode(tokenize(request(tool_choice="none"), tok))


@pytest.mark.parametrize("name", list(VARIANTS))
def test_an_agent_loop_renders_calls_and_results_as_text(variants, name):
    tok = variants[name].tokenizer
    follow_up = LOOP + [{"role": "user", "content": "And in Rome?"}]
    for msgs in (LOOP, follow_up):
        for choice in ("auto", "none"):
            text = tok.decode(tokenize(request(messages=msgs, tool_choice=choice), tok))
            assert CALLS_TEXT in text and RESULTS_TEXT in text, text
            assert ("You can call" in text) == (choice == "auto")
            if name == "gemma":  # turns alternate: the results and the follow-up are one user turn
                assert text.count("<|user|>") == 2 and text.count("<|assistant|>") == 2
                assert (RESULTS_TEXT + "\n\nAnd in Rome?" in text) == (msgs is follow_up)
            elif name != "plain":
                assert "<|user|>\n" + RESULTS_TEXT + "<|end|>" in text and "<|tool|>" not in text
                assert "<|assistant|>\n" + CALLS_TEXT + "<|end|>" in text


def test_the_slot_template_keeps_its_own_rendering(tiny_model):
    """The tiny template renders tools itself: mlxq adds no description of its own."""
    tok = tiny_model.tokenizer
    text = tok.decode(tokenize(request(messages=LOOP, tool_choice="required"), tok))
    assert "You can call" not in text and "# Tools" in text


@pytest.mark.parametrize("name", ["chatml", "gemma"])
def test_the_grammar_holds_any_choice_to_the_own_format(variants, name):
    """Whatever the model picks among the tokens the grammar allows: named and required give valid
    calls (one without parallel calls), auto gives text or calls, a call it starts constrained."""
    tok = variants[name].tokenizer
    fmt = serving_format(tok)
    ll_tok = llguidance.hf.from_tokenizer(tok._tokenizer, eos_token=list(variants[name].eos_token_ids))
    eos = variants[name].eos_token_ids[0]
    think_end = fmt.think_end_ids[0]
    for key, choice in CHOICES.items():
        for parallel in (True, False):
            req = request(f"tiny-{name}", tool_choice=choice, parallel_tool_calls=parallel)
            grammar = grammar_for(req, fmt)
            assert grammar == tool_grammar(req, fmt)
            # auto: the model writes some text, then starts a call (the grammar must allow both)
            prefix = tok.encode("Let me check. " + TOOL_CALL_START, add_special_tokens=False) if key == "auto" else ()
            for seed in range(3):
                ids, ended = sample(ll_tok, grammar, seed, prefer=[think_end, eos], eos=eos, max_tokens=400,
                                    prefix=prefix)
                stream = chat_stream(tok, req, [])
                answer = "".join(stream.add(t) for t in ids) + stream.finish()
                if key == "auto":  # the text before the call is the answer; the call the prefix began is whole
                    assert answer.startswith("Let me check. "), answer
                else:
                    assert ended and answer.strip() == "", (key, answer)
                check_calls(stream.calls, ("get_weather",) if key == "named" else tuple(SCHEMAS))
                assert len(stream.calls) == 1 or parallel and key != "named"
                assert TOOL_CALL_START not in answer


def test_a_schema_the_grammar_cannot_compile_is_refused(variants):
    """Before queueing (the request's validation), and by the worker for a request that skipped it."""
    from mlxq.shared.schemas import Tool
    from mlxq.worker.jobs import JobError

    bad = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "strin"}}}}}
    with pytest.raises(ValueError, match="'f'.*not supported"):
        request(tools=[bad], tool_choice="required")
    tok = variants["chatml"].tokenizer
    req = request().model_copy(update={"tools": [Tool.model_validate(bad)], "tool_choice": "required"})
    with pytest.raises(ToolError, match="'f'.*not supported"):
        check_tools(req, serving_format(tok))
    with pytest.raises(JobError, match="'f'.*not supported"):
        tokenize(req, tok)


def push_raw(client, model: str, fields: dict) -> str:
    """Queue a request as a producer that skips validation would (straight into Redis)."""
    from mlxq.shared import codec
    from mlxq.shared.keys import ModelKeys
    from mlxq.shared.protocol import Queue
    from mlxq.shared.schemas import new_job_id

    job_id = new_job_id()
    raw = {"id": job_id, "model": model, "max_tokens": 8, "source": "client", **fields}
    Queue(client.redis, ModelKeys(model), client.settings).enqueue(job_id, codec.pack(raw), global_redis=client.redis)
    return job_id


@pytest.mark.parametrize("name", list(VARIANTS))
def test_tool_jobs_end_to_end_for_any_template(variants, redis_url, name):
    """Through a real worker and Client, every choice with and without parallel calls: named and
    required come back as calls whose arguments follow their schemas, finish_reason "tool_calls"."""
    loaded = variants[name]
    tok = loaded.tokenizer
    fmt = serving_format(tok)
    model = f"tiny-{name}"
    settings = fast_settings(redis_url)
    client = Client(redis_url, model=model, settings=settings)
    eos = loaded.eos_token_ids[0]
    # no free thought first (the untrained <think> could run to the budget); end once the grammar lets
    # the model (after the first whole call: how many more it would write is its own choice)
    no_thought = {tok.get_vocab()[THINK_START]: -100.0}
    bias = {**no_thought, eos: 100.0}
    # auto, one call at most, a start marker of one token: the bias makes the model start a call (the
    # grammar then holds it to a schema, and ends the output after it)
    start_call = {**no_thought, fmt.tool_call_start_ids[0]: 100.0} if len(fmt.tool_call_start_ids) == 1 else None
    with running_worker(loaded, redis_url, settings, max_batch=8):
        jobs = {}
        for key, choice in CHOICES.items():
            for parallel in (True, False):
                extra = {"temperature": 0.8, "seed": 3} if parallel else {}
                forced = key == "auto" and not parallel and start_call
                jobs[key, parallel] = client.submit(
                    messages=MESSAGES, tools=TOOLS, tool_choice=choice, parallel_tool_calls=parallel,
                    max_tokens=200, logit_bias=start_call if forced else bias, **extra)
        jobs["loop"] = client.submit(messages=LOOP + [{"role": "user", "content": "And in Rome?"}], tools=TOOLS,
                                     tool_choice="required", max_tokens=200, logit_bias=bias)
        results = {k: j.result(timeout=300) for k, j in jobs.items()}
        # a schema that cannot compile, queued past the producer's checks: refused, the worker serves on
        bad = push_raw(client, model, {"messages": MESSAGES, "tool_choice": "required", "tools": [
            {"type": "function", "function": {"name": "f", "parameters": {
                "type": "object", "properties": {"a": {"type": "nope"}}}}}]})
        refused = client.job(bad).result(timeout=120)
        after = client.submit(messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=200,
                              logit_bias=bias).result(timeout=120)
    for (key, parallel), res in ((k, r) for k, r in results.items() if k != "loop"):
        names = ("get_weather",) if key == "named" else tuple(SCHEMAS)
        if key != "auto" or res.tool_calls:
            assert res.finish_reason == "tool_calls", (key, parallel, res)
            check_calls([c.model_dump() for c in res.tool_calls], names)
            assert len(res.tool_calls) == 1 or parallel
        else:  # auto, and the model answered in text
            assert res.finish_reason in ("stop", "length")
        assert TOOL_CALL_START not in res.text and TOOL_CALL_END not in res.text
    if start_call:  # the bias started a call, which the grammar held to a schema
        assert len(results["auto", False].tool_calls) == 1
    assert results["loop"].finish_reason == "tool_calls"
    check_calls([c.model_dump() for c in results["loop"].tool_calls])
    assert refused.finish_reason == "error" and refused.error_code == "invalid_request" and "'f'" in refused.error
    assert after.finish_reason == "tool_calls"
