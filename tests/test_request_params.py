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
