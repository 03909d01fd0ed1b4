"""The engine (paged continuous batching) against mlx-lm's single-sequence decoding (random-weight models)."""

from __future__ import annotations

import random

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models import qwen3

from mlxq.shared.schemas import SamplingParams
from mlxq.worker.engine import PagedEngine
from mlxq.worker.engine.api import SeqSpec
from mlxq.worker.engine.sampler import make_sampler
from refkit import reference_processors
from enginekit import _gemma3, drive, tiny_llama


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
                       logits_processors=reference_processors(params))
    alone = drive(PagedEngine(model, num_blocks=32), {0: [ref_spec]})["alone"]
    a = SeqSpec(uid="a", prompt=prompt, max_tokens=25, sampler=make_sampler(params, 3),
                logits_processors=reference_processors(params))
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


# Sliding-window layers: the ragged mask must keep each row's window (the same tiny gemma3 as
# the paged-engine tests).
tiny_gemma3 = _gemma3


@pytest.mark.parametrize("make_model", [tiny_llama, tiny_qwen3, tiny_gemma3])
def test_batched_prefill_one_ragged_pass_equals_single_sequence(make_model):
    model = make_model()
    rng = random.Random(11)
    lens = [40, 40, 40, 7, 1, 33, 58, 40]  # equal and ragged rows in one pass
    specs = [SeqSpec(uid=f"b{i}", prompt=[rng.randrange(1, 256) for _ in range(n)], max_tokens=12)
             for i, n in enumerate(lens)]
    refs = {s.uid: reference(model, s.prompt, s.max_tokens) for s in specs}
    # budget 512 >= 8 rows x 58 (the widest): every prompt in one forward pass
    engine = PagedEngine(model, num_blocks=64, step_token_budget=512)
    out = drive(engine, {0: specs})
    assert out == refs
    assert engine.counters.prefill_passes == 1
    assert engine.stats()["blocks_used"] == 0


def test_batched_prefill_respects_the_token_budget():
    model = tiny_llama()
    rng = random.Random(12)
    specs = [SeqSpec(uid=f"c{i}", prompt=[rng.randrange(1, 256) for _ in range(30)], max_tokens=5)
             for i in range(6)]
    seen = []
    engine = PagedEngine(model, num_blocks=64, step_token_budget=64,
                         chunk_schedule=((None, 16),))
    engine.add(specs)
    while engine.has_work():
        before = engine.counters.prefill_tokens
        events, _ = engine.step()
        seen.append(engine.counters.prefill_tokens - before)
    assert max(seen) <= 64 and engine.counters.prefill_tokens == 6 * 30
    assert engine.counters.prefill_passes < 6 * 2  # rows shared passes
    out = drive(PagedEngine(model, num_blocks=64, step_token_budget=64, chunk_schedule=((None, 16),)),
                {0: [SeqSpec(s.uid, s.prompt, s.max_tokens) for s in specs]})
    assert out == {s.uid: reference(model, s.prompt, 5) for s in specs}


def _seeded(uid, prompt, n, seed, **kw):
    params = SamplingParams(temperature=0.9, top_p=0.9, seed=seed, **kw)
    return SeqSpec(uid=uid, prompt=prompt, max_tokens=n, sampler=make_sampler(params, seed),
                   logits_processors=reference_processors(params))


def test_seeded_sampled_job_same_alone_and_in_any_batch():
    model = tiny_llama()
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    alone = drive(PagedEngine(model, num_blocks=64), {0: [_seeded("x", prompt, 20, 7)]})["x"]
    others = [_seeded(f"o{i}", [i + 2] * (i + 3), 15, 100 + i) for i in range(4)]  # same config
    mixed = [SeqSpec(uid="g", prompt=[8, 8, 8], max_tokens=30),  # greedy
             _seeded("k", [9, 9], 25, 5, top_k=20),  # another config
             _seeded("r", [7, 6, 5], 25, 6, repetition_penalty=1.3)]  # a logits processor
    for arrivals in ({0: [_seeded("x", prompt, 20, 7)] + others},
                     {0: others + mixed, 3: [_seeded("x", prompt, 20, 7)]},
                     {0: mixed[:1], 1: [_seeded("x", prompt, 20, 7)], 4: others[:2] + mixed[1:]}):
        out = drive(PagedEngine(model, num_blocks=64), arrivals)
        assert out["x"] == alone
    assert len(set(alone)) > 1
    # and across a preemption: resumed at step n of its own key stream
    engine = PagedEngine(model, num_blocks=4, pressure=1.0)  # room for one sequence
    params = SamplingParams(temperature=0.9, top_p=0.9, seed=7)
    x = SeqSpec(uid="x", prompt=prompt, max_tokens=20, sampler=make_sampler(params, 7), priority=5.0)
    urgent = SeqSpec(uid="u", prompt=[1] * 70, max_tokens=3, priority=0.0)
    got, step, preempted_at = [], 0, None
    engine.add([x])
    while engine.has_work():
        if step == 6:
            engine.add([urgent])
        events, preempted = engine.step()
        got += [e.token for e in events if e.uid == "x"]
        for p in preempted:
            assert p.uid == "x" and p.tokens == got
            preempted_at = len(got)
            engine.add([SeqSpec(uid="x", prompt=prompt, max_tokens=20 - len(got), resume_tokens=list(got),
                                sampler=make_sampler(params, 7, start_step=len(got)), priority=5.0)])
        step += 1
    assert preempted_at and 0 < preempted_at < 20
    assert got == alone


def test_logprobs_only_for_jobs_that_ask():
    model = tiny_llama()
    engine = PagedEngine(model, num_blocks=32)
    engine.add([SeqSpec(uid="lp", prompt=[1, 2, 3], max_tokens=4, want_logprobs=True),
                SeqSpec(uid="no", prompt=[1, 2, 3], max_tokens=4)])
    got = {"lp": [], "no": []}
    while engine.has_work():
        for e in engine.step()[0]:
            got[e.uid].append(e)
    assert all(e.logprobs is None for e in got["no"])
    ref = list(generate_step(mx.array([1, 2, 3]), model, max_tokens=4))
    for e, (tok, lp) in zip(got["lp"], ref):
        assert e.token == int(tok)
        assert mx.allclose(e.logprobs, lp, atol=1e-5).item()


def test_blocks_return_to_baseline_after_a_load_run():
    model = tiny_llama()
    rng = random.Random(5)
    system = [rng.randrange(1, 256) for _ in range(64)]  # two full blocks every prompt shares
    engine = PagedEngine(model, num_blocks=20, pressure=1.0)  # small: admission waits, preemption happens
    # speculating at every step a row has a proposal: a schedule that does not follow step times (the test
    # needs its preemption), with the verify passes in it
    engine.speculator.costs.always = True
    baseline = engine.stats()
    specs = [SeqSpec(uid=f"l{i}", prompt=system + [rng.randrange(1, 256) for _ in range(rng.randrange(1, 40))],
                     max_tokens=rng.randrange(5, 60), priority=float(i % 3)) for i in range(16)]
    engine.add(specs[:1])
    out: dict = {}
    step = 0
    pending = list(specs[1:])
    while engine.has_work() or pending:
        if pending and step % 2 == 0:
            engine.add([pending.pop(0)])
        if step == 9:
            engine.remove(["l2"])  # a cancel mid-run
        events, preempted = engine.step()
        for p in preempted:
            s = next(x for x in specs if x.uid == p.uid)
            engine.add([SeqSpec(s.uid, s.prompt, s.max_tokens - len(p.tokens) + len(s.resume_tokens),
                                resume_tokens=list(p.tokens), priority=s.priority)])
        for e in events:
            out.setdefault(e.uid, []).append(e.token)
        step += 1
    st = engine.stats()
    assert st["prefix_hit_tokens"] > 0 and st["preemptions"] > 0 and st["verify_passes"] > 0
    assert st["blocks_used"] == baseline["blocks_used"] == 0
    assert st["blocks_free"] + st["blocks_cached"] == baseline["blocks_total"]
    engine.bm.check_invariants()


def test_solo_reference_is_mlx_lm_greedy_up_to_rounding(tiny_model, tiny_model_dir):
    """The fault tests' references (``faultkit.reference_tokens``: the worker's engine with one
    sequence) against mlx-lm itself, for any weights: mlx-lm's own model (a fresh load, MLX's matmul
    and attention) reads the prompt and the engine's 300 greedy tokens in one pass, and at every
    position the engine's token is mlx-lm's argmax, or within rounding of it (a near-tie that two
    correct summation orders may break either way). Which positions are near-ties depends on the
    weights; that all but a few are mlx-lm's exact argmax does not."""
    import mlx_lm
    import numpy as np

    from faultkit import reference_tokens

    theirs, _ = mlx_lm.load(str(tiny_model_dir))
    near_ties = 0
    for prompt in ([5, 6, 7, 8], tiny_model.tokenizer.encode("The old bridge over the river")):
        ours = reference_tokens(tiny_model, prompt, 300, ignore_eos=True)
        logits = np.array(theirs(mx.array([prompt + ours[:-1]]))[0, len(prompt) - 1:].astype(mx.float32))
        top = logits.max(axis=-1)
        gap = top - logits[np.arange(len(ours)), ours]
        assert gap.max() <= 1e-3 * max(1.0, float(np.abs(top).max())), gap.max()
        near_ties += int((gap > 0).sum())
    assert near_ties <= 6
