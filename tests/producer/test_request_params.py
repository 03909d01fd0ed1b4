"""Request parameters that were accepted and silently not applied: each now works or is refused."""

from __future__ import annotations

import json

import llguidance
import llguidance.hf
import pytest

from mlxq.shared.schemas import GenerateRequest
from mlxq.worker.textstream import chat_format


# -- a tool's function.strict --------------------------------------------------------------------------

OPEN = {"type": "object", "properties": {"a": {"type": "integer"},
                                         "b": {"type": "object", "properties": {"c": {"type": "integer"}}}}}


def _tool_request(strict):
    fn = {"name": "f", "parameters": OPEN, **({} if strict is None else {"strict": strict})}
    return GenerateRequest.model_validate({"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                           "tools": [{"type": "function", "function": fn}],
                                           "tool_choice": {"type": "function", "function": {"name": "f"}}})


def test_a_tool_closes_its_arguments_objects_unless_strict_is_false(tiny_model):
    """A tool's arguments are held to the keys the schema lists, at every level, as vLLM's grammar
    backend holds them (and as ``strict: true`` asks); ``strict: false`` keeps the schema as written
    and allows extra keys."""
    from mlxq.shared.tools import tool_grammar

    tok = tiny_model.tokenizer
    fmt = chat_format(tok)
    ll_tok = llguidance.hf.from_tokenizer(tok._tokenizer)
    prefix = fmt.tool_call_start + '\n{"name": "f", "arguments": '
    for strict, extra_ok in ((None, False), (False, True), (True, False)):
        grammar = tool_grammar(_tool_request(strict), fmt)
        for args in ('{"a": 1, "x": 2}', '{"a": 1, "b": {"c": 2, "x": 3}}'):
            m = llguidance.LLMatcher(ll_tok, grammar, log_level=0)
            ids = tok._tokenizer.encode(prefix + args, add_special_tokens=False)
            assert m.consume_tokens(ids) == extra_ok, (strict, args)
        m = llguidance.LLMatcher(ll_tok, grammar, log_level=0)
        assert m.consume_tokens(tok._tokenizer.encode(prefix + '{"a": 1, "b": {"c": 2}}', add_special_tokens=False))


def test_a_non_boolean_strict_is_refused():
    for bad in ("true", 1, "yes"):
        with pytest.raises(ValueError, match="strict"):
            _tool_request(bad)


# -- a temperature too small to divide by -----------------------------------------------------------------

def test_a_tiny_temperature_samples_greedily():
    """A temperature under 1e-5 (as vLLM) is greedy: 1e-40 passed validation, and 1 / temperature
    overflowed float32 to inf, so the probabilities were NaN and the tokens garbage."""
    from mlxq.shared.schemas import GREEDY_BELOW, SamplingParams
    from mlxq.worker.engine import PagedEngine
    from mlxq.worker.engine.api import SeqSpec
    from mlxq.worker.engine.sampler import RowSampler, make_sampler
    from enginekit import drive, tiny_llama

    model = tiny_llama()
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    out = {}
    for temp in (0.0, 1e-40, 1e-30, GREEDY_BELOW / 2):
        params = SamplingParams(temperature=temp, seed=5)
        assert params.greedy
        spec = SeqSpec(uid="x", prompt=prompt, max_tokens=12, sampler=make_sampler(params, 5))
        out[temp] = drive(PagedEngine(model, num_blocks=64), {0: [spec]})["x"]
    assert len(out[0.0]) == 12 and all(toks == out[0.0] for toks in out.values()), out
    assert not SamplingParams(temperature=GREEDY_BELOW).greedy
    with pytest.raises(ValueError, match="greedily"):
        RowSampler(SamplingParams(temperature=1e-40), 5)


# -- max_tokens beyond the model's context ---------------------------------------------------------------

def _req(**kw):
    return GenerateRequest.model_validate({"model": "tiny", "prompt": "x", **kw})


def test_max_tokens_past_the_context_is_refused_when_given_and_cut_when_not():
    """An explicit max_tokens the context cannot hold after the prompt is refused, naming both (as
    vLLM); it was accepted, and the job ran past the model's context.  The default is cut to the
    context, so the job ends with "length" there."""
    from mlxq.producer.core import check_fits
    from mlxq.producer.errors import ContextLengthError
    from mlxq.producer.core import prepare
    from mlxq.shared import codec
    from mlxq.worker.jobs import JobError
    from mlxq.worker.fetcher import fit_context

    with pytest.raises(JobError, match="context is 64 tokens; the prompt has 60 and max_tokens asks for 10"):
        fit_context(_req(max_tokens=10), 60, 64)
    with pytest.raises(JobError, match="exceeds the model's context of 64"):
        fit_context(_req(max_tokens=1), 64, 64)
    given = _req(max_tokens=4)
    fit_context(given, 60, 64)
    assert given.max_tokens == 4
    default = _req()
    fit_context(default, 60, 64)
    assert default.max_tokens == 4  # 256 by default, cut to what the context leaves
    # the producer refuses what it can count (exact ids here), and sends no max_tokens not given
    info = {"context_length": 64, "vocab_size": 100, "max_token_bytes": 8}
    with pytest.raises(ContextLengthError, match="prompt has 60 and max_tokens asks for 10"):
        check_fits(GenerateRequest(model="tiny", prompt_tokens=[1] * 60, max_tokens=10), info)
    check_fits(GenerateRequest(model="tiny", prompt_tokens=[1] * 60), info)
    assert "max_tokens" not in codec.unpack(prepare("tiny", {"prompt_tokens": [1] * 60}, info, 1 << 20).payload)
    assert codec.unpack(prepare("tiny", {"prompt": "x", "max_tokens": 7}, info, 1 << 20).payload)["max_tokens"] == 7


def test_the_worker_refuses_an_explicit_max_tokens_past_the_context(tiny_model, redis_url):
    """Through a worker (submitted before any registered, so only the worker can check): an explicit
    max_tokens past the context is an invalid_request naming prompt and max_tokens; without one the
    job generates to the context's end and finishes with "length"."""
    from mlxq import Client
    from workerkit import fast_settings, running_worker

    settings = fast_settings(redis_url)
    client = Client(redis_url, model="tiny", settings=settings)
    ctx = tiny_model.context_length
    prompt = [5] * (ctx - 6)
    over = client.submit(prompt_tokens=prompt, max_tokens=10, ignore_eos=True)
    capped = client.submit(prompt_tokens=prompt, ignore_eos=True)
    with running_worker(tiny_model, redis_url, settings):
        res_over, res_capped = over.result(timeout=60), capped.result(timeout=60)
    assert res_over.finish_reason == "error"
    assert f"context is {ctx} tokens; the prompt has {ctx - 6} and max_tokens asks for 10" in res_over.error
    assert res_capped.finish_reason == "length" and len(res_capped.token_ids) == 6
