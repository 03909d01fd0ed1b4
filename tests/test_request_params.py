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


def test_a_strict_tool_closes_its_arguments_objects(tiny_model):
    """``function.strict: true`` holds the arguments to the keys the schema lists, at every level (as
    a response_format with ``strict: true``); it was ignored, and extra keys were allowed."""
    from mlxq.shared.tools import tool_grammar

    tok = tiny_model.tokenizer
    fmt = chat_format(tok)
    ll_tok = llguidance.hf.from_tokenizer(tok._tokenizer)
    prefix = fmt.tool_call_start + '\n{"name": "f", "arguments": '
    for strict, extra_ok in ((None, True), (False, True), (True, False)):
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
    from mlxq.worker.engine.sampler import RowSampler
    from mlxq.worker.engine_api import SeqSpec
    from mlxq.worker.sampling import make_sampler
    from test_engine import drive, tiny_llama

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
