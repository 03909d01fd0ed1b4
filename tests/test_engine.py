"""The engine (paged continuous batching) against mlx-lm's single-sequence decoding (random-weight models)."""

from __future__ import annotations

import mlxq.worker  # noqa: F401  (BLAS before mlx)

import random

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models import llama, qwen3

from mlxq.shared.schemas import SamplingParams
from mlxq.worker.paged import PagedEngine
from mlxq.worker.engine_api import SeqSpec
from mlxq.worker.sampling import make_processors, make_sampler


def tiny_llama():
    mx.random.seed(0)
    args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                           num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=256,
                           tie_word_embeddings=True)
    m = llama.Model(args)
    mx.eval(m.parameters())
    return m


def tiny_qwen3():
    mx.random.seed(1)
    args = qwen3.ModelArgs(model_type="qwen3", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                           num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, vocab_size=256,
                           head_dim=16, max_position_embeddings=512, rope_theta=10000.0, tie_word_embeddings=True)
    m = qwen3.Model(args)
    mx.eval(m.parameters())
    return m


def reference(model, prompt, n, sampler=None, processors=None):
    return [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=n, sampler=sampler,
                                              logits_processors=processors)]


def drive(engine, arrivals, max_steps=2000):
    """arrivals: {step: [SeqSpec]}; returns {uid: [tokens]}."""
    out: dict[str, list[int]] = {}
    step = 0
    while (engine.has_work() or any(k >= step for k in arrivals)) and step < max_steps:
        if step in arrivals:
            engine.add(arrivals[step])
        events, _ = engine.step()
        for e in events:
            out.setdefault(e.uid, []).append(e.token)
        step += 1
    return out


@pytest.mark.parametrize("make_model", [tiny_llama, tiny_qwen3])
def test_staggered_greedy_equals_single_sequence(make_model):
    model = make_model()
    rng = random.Random(0)
    specs = [SeqSpec(uid=f"j{i}", prompt=[rng.randrange(1, 256) for _ in range(rng.randrange(1, 50))],
                     max_tokens=rng.randrange(1, 30)) for i in range(20)]
    refs = {s.uid: reference(model, s.prompt, s.max_tokens) for s in specs}
    arrivals: dict[int, list] = {}
    for i, s in enumerate(specs):
        arrivals.setdefault(i * 2 if i % 3 else i * 2 + 1, []).append(s)
    engine = PagedEngine(model, num_blocks=64, max_batch=5)
    out = drive(engine, arrivals)
    assert out == refs
    # joins never recompute: every prompt token is prefilled exactly once
    assert engine.counters.prefill_tokens == engine.counters.prompt_tokens - engine.counters.prefix_hit_tokens


def test_solo_then_join_keeps_seeded_sampling_exact():
    model = tiny_llama()
    params = SamplingParams(temperature=0.8, top_k=50, repetition_penalty=1.2, seed=3)
    prompt = [5, 6, 7, 8]
    ref_spec = SeqSpec(uid="alone", prompt=prompt, max_tokens=25, sampler=make_sampler(params, 3),
                       logits_processors=make_processors(params))
    alone = drive(PagedEngine(model, num_blocks=32), {0: [ref_spec]})["alone"]
    a = SeqSpec(uid="a", prompt=prompt, max_tokens=25, sampler=make_sampler(params, 3),
                logits_processors=make_processors(params))
    b = SeqSpec(uid="b", prompt=[9, 10], max_tokens=10)
    out = drive(PagedEngine(model, num_blocks=32), {0: [a], 5: [b]})
    assert out["a"] == alone
    assert out["b"] == reference(model, [9, 10], 10)


def test_remove_and_stop_tokens():
    model = tiny_llama()
    ref = reference(model, [1, 2, 3], 20)
    eos = ref[5]
    engine = PagedEngine(model, num_blocks=32, eos_token_ids=(eos,))
    engine.add([SeqSpec(uid="s", prompt=[1, 2, 3], max_tokens=20, stop_token_ids=(eos,)),
                SeqSpec(uid="r", prompt=[4, 5], max_tokens=50)])
    seen, finish = [], None
    for _ in range(10):
        events, _ = engine.step()
        for e in events:
            if e.uid == "s":
                seen.append(e.token)
                finish = e.finish_reason or finish
    engine.remove(["r"])
    assert not engine.has_work()
    assert seen == ref[: ref.index(eos) + 1] and finish == "stop"
