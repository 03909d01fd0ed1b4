"""Tools and a first message the tool-calling tests share (worker, gateway, compaction), the check that
calls are valid for their tools, and a stand-in for any model's choices under a grammar."""

from __future__ import annotations

import json
import random

import jsonschema
import numpy as np

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome", "Zürich"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 5},
        "units": {"type": "string", "enum": ["C", "F"]},
    },
    "required": ["city", "days", "units"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "maxLength": 8}, "utc": {"type": "boolean"}},
    "required": ["zone", "utc"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "Time in a zone", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


def check_calls(calls, names=tuple(SCHEMAS)) -> None:
    """Every call names one of ``names`` and its arguments are valid JSON for that tool's schema."""
    assert calls
    for call in calls:
        fn = call["function"] if "function" in call else call
        assert fn["name"] in names
        jsonschema.validate(json.loads(fn["arguments"]), SCHEMAS[fn["name"]])


def sample(ll_tok, grammar: str, seed: int, prefer=(), eos: int = 2, max_tokens: int = 2000,
           prefix=()) -> tuple[list[int], bool]:
    """Tokens drawn at random among those the grammar allows (``prefer``: taken half the time when
    allowed; EOS a quarter of the time when allowed): a stand-in for any model's choices.  ``prefix``:
    tokens the model wrote first (the grammar must allow them)."""
    import llguidance

    m = llguidance.LLMatcher(ll_tok, grammar, log_level=0)
    assert not m.is_error(), m.get_error()
    assert m.consume_tokens(list(prefix)), m.get_error()
    rng, out = random.Random(seed), list(prefix)
    for _ in range(max_tokens):
        allowed = np.nonzero(np.frombuffer(m.compute_logit_bias(), dtype=np.uint8)[:ll_tok.vocab_size])[0].tolist()
        pref = [t for t in prefer if t in allowed]
        if eos in allowed and (rng.random() < 0.25 or allowed == [eos]):
            return out, True
        t = rng.choice(pref if pref and rng.random() < 0.5 else allowed)
        if t == eos:
            return out, True
        assert m.consume_token(t), m.get_error()
        out.append(t)
    return out, False
