"""PagedEngine end to end: greedy equality with dense mlx-lm, prefix cache,
admission, preemption + resume, chunked prefill, sessions, no block leaks."""

import os
import random
from dataclasses import replace

import mlx.core as mx
import pytest
from mlx_lm.models import qwen3

from mlxq.worker.engine.api import SeqSpec
from mlxq.worker.engine import PagedEngine

from enginekit import SMALL_CHUNKS, _assert_no_leak, _gemma3, _llama, _prompts, dense, random_llama, run, warm_count


def _qwen3():
    mx.random.seed(4)
    m = qwen3.Model(qwen3.ModelArgs(
        model_type="qwen3", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=256,
        max_position_embeddings=4096, head_dim=16, tie_word_embeddings=True, rope_theta=1e6))
    mx.eval(m.parameters())
    return m


@pytest.fixture(scope="module")
def model():
    return _llama()


@pytest.mark.parametrize("make", [_llama, _qwen3, _gemma3], ids=["llama", "qwen3", "gemma3"])
def test_greedy_equals_dense_many_concurrent(make):
    m = make()
    prompts = _prompts(1, 10, 1, 140)
    lens = [12, 5, 20, 1, 16, 9, 14, 20, 3, 11]
    eng = PagedEngine(m, num_blocks=96, chunk_schedule=SMALL_CHUNKS, step_token_budget=40)
    specs = [SeqSpec(f"s{i}", p, n) for i, (p, n) in enumerate(zip(prompts, lens))]
    out, done, _ = run(eng, specs)
    for s in specs:
        assert out[s.uid] == dense(m, s.prompt, s.max_tokens), s.uid
        assert done[s.uid] == "length"
    _assert_no_leak(eng)


def test_prefix_hits_share_blocks_and_match_dense(model):
    system = _prompts(2, 1, 100, 100)[0]  # 3 full blocks
    qs = _prompts(3, 6, 1, 20)
    eng = PagedEngine(model, num_blocks=64)
    specs = [SeqSpec("first", system + qs[0], 6)]
    out, _, _ = run(eng, specs)
    assert eng.stats()["prefix_hit_tokens"] == 0
    specs = [SeqSpec(f"q{i}", system + q, 6) for i, q in enumerate(qs[1:])]
    seen_shared = []

    def on_step(i, events):
        tables = [s.block_table[:3] for s in eng.scheduler.running.values()]
        if len(tables) > 1:
            seen_shared.append(all(t == tables[0] for t in tables))

    out, _, _ = run(eng, specs, on_step=on_step)
    st = eng.stats()
    assert st["prefix_hit_tokens"] == 96 * 5
    assert st["prompt_tokens"] == sum(len(system + q) for q in qs)
    assert seen_shared and all(seen_shared)  # the shared blocks are referenced, not copied
    for s in specs:
        assert out[s.uid] == dense(model, s.prompt, 6)
    _assert_no_leak(eng)


def test_hit_is_capped_below_prompt_length(model):
    p = _prompts(4, 1, 64, 64)[0]  # exactly two blocks
    eng = PagedEngine(model, num_blocks=16)
    run(eng, [SeqSpec("a", p, 3)])
    out, _, _ = run(eng, [SeqSpec("b", p, 3)])
    assert eng.stats()["prefix_hit_tokens"] == 32  # never the whole prompt
    assert out["b"] == dense(model, p, 3)


def test_preemption_resume_is_exact_and_never_repeats(model):
    prompts = _prompts(5, 6, 20, 60)
    # speculation off: the test needs the preemption a one-token-a-step schedule gives
    eng = PagedEngine(model, num_blocks=14, pressure=1.0, chunk_schedule=SMALL_CHUNKS, speculate="off")
    specs = [SeqSpec(f"p{i}", p, 40, priority=float(i % 3)) for i, p in enumerate(prompts)]
    out, done, n_pre = run(eng, specs)
    assert n_pre > 0 and eng.stats()["preemptions"] == n_pre
    for s in specs:
        assert out[s.uid] == dense(model, s.prompt, 40), s.uid
        assert done[s.uid] == "length"
    _assert_no_leak(eng)


def test_urgent_job_preempts_lowest_priority_newest(model):
    eng = PagedEngine(model, num_blocks=10, pressure=1.0)
    low = [SeqSpec(f"low{i}", _prompts(6 + i, 1, 60, 60)[0], 50, priority=10.0)
           for i in range(3)]
    eng.add(low)
    prior = {s.uid: [] for s in low}
    for e in eng.step()[0]:
        prior[e.uid].append(e.token)
    assert len(eng.scheduler.running) == 3
    # 3 x 2 blocks used; the urgent job needs 4 + 1 reserve of the 10
    urgent = SeqSpec("urgent", _prompts(9, 1, 120, 120)[0], 5, priority=0.0)
    eng.add([urgent])
    events, preempted = eng.step()
    for e in events:
        prior.setdefault(e.uid, []).append(e.token)
    assert [p.uid for p in preempted] == ["low2"]  # newest of the lowest priority
    assert "urgent" in eng.scheduler.running
    # the victim resumes from its cached blocks and ends exactly as it would have
    p = preempted[0]
    del prior["low2"]  # now carried by its resume tokens
    out, _, _ = run(eng, [replace(low[2], resume_tokens=p.tokens,
                                  max_tokens=50 - len(p.tokens))],
                 added=low[:2] + [urgent], prior=prior)
    assert eng.stats()["prefix_hit_tokens"] >= 32
    assert out["low2"] == dense(model, low[2].prompt, 50)
    # a job within the priority gap does not preempt
    eng2 = PagedEngine(model, num_blocks=10, pressure=1.0, priority_gap=5.0)
    eng2.add(low)
    eng2.step()
    eng2.add([replace(urgent, priority=9.0)])
    _, preempted = eng2.step()
    assert preempted == [] and eng2.stats()["waiting"] == 1


def test_admission_waits_when_pool_is_full(model):
    eng = PagedEngine(model, num_blocks=12, pressure=0.85)
    specs = [SeqSpec(f"a{i}", _prompts(10 + i, 1, 90, 90)[0], 4) for i in range(4)]
    eng.add(specs)
    eng.step()
    st = eng.stats()
    # 3 blocks each; the 4th would bring used + reserve to 13 > 85% of 12
    assert st["running"] == 3 and st["waiting"] == 1
    # the worker keeps pulling while jobs wait here for memory, up to max_waiting
    assert eng.free_slots() == eng.scheduler.config.max_waiting - 1
    eng.scheduler.config = replace(eng.scheduler.config, max_waiting=1)
    assert eng.free_slots() == 0
    assert eng.can_admit(90, 4) and not eng.can_admit(400, 10)
    out, _, _ = run(eng, [], added=specs)
    _assert_no_leak(eng)


def test_max_batch_pins_the_batch(model):
    eng = PagedEngine(model, num_blocks=64, max_batch=2)
    assert eng.free_slots() == 2
    specs = [SeqSpec(f"m{i}", [i + 1] * 10, 3) for i in range(3)]
    eng.add(specs)
    assert eng.free_slots() == 0
    eng.step()
    assert eng.stats()["running"] == 2
    out, _, _ = run(eng, [], added=specs)


def test_chunked_prefill_keeps_streams_going(model):
    # speculation off: the test counts one token per stream per step
    eng = PagedEngine(model, num_blocks=64, chunk_schedule=((None, 32),), step_token_budget=40, speculate="off")
    streams = [SeqSpec(f"s{i}", [i + 1] * 8, 30) for i in range(3)]
    eng.add(streams)
    for _ in range(3):
        eng.step()
    long = SeqSpec("long", _prompts(11, 1, 300, 300)[0], 4)
    eng.add([long])
    steps_with_stream_tokens = 0
    while eng.scheduler.waiting or any(s.status.value == "prefill" for s in eng.scheduler.running.values()):
        events, _ = eng.step()
        assert len([e for e in events if e.uid.startswith("s")]) == 3
        steps_with_stream_tokens += 1
    assert steps_with_stream_tokens >= 300 // 40  # prompt split over many steps
    out, _, _ = run(eng, [], added=streams + [long])


def test_stop_tokens_sampler_and_processors(model):
    prompt = [5, 6, 7, 8]
    ref = dense(model, prompt, 10)
    eng = PagedEngine(model, num_blocks=16, eos_token_ids=[ref[3]])
    out, done, _ = run(eng, [SeqSpec("e", prompt, 10)])
    assert out["e"] == ref[: ref.index(ref[3]) + 1] and done["e"] == "stop"

    calls = []

    def sampler(logprobs):
        calls.append(logprobs.shape)
        return mx.array([42])

    def ban_42(ctx, logits):
        return logits.at[:, 42].add(-1e9)

    eng = PagedEngine(model, num_blocks=16)
    out, _, _ = run(eng, [SeqSpec("s", prompt, 3, sampler=sampler),
                          SeqSpec("p", prompt, 3, logits_processors=[ban_42])])
    assert out["s"] == [42, 42, 42] and calls == [(1, 256)] * 3
    assert 42 not in out["p"]


def test_session_hot_then_warm_across_restart(model, tmp_path):
    turn1 = _prompts(12, 1, 80, 80)[0]
    eng = PagedEngine(model, num_blocks=32, session_dir=str(tmp_path), model_id="tiny")
    out, _, _ = run(eng, [SeqSpec("t1", turn1, 20, session_id="chat")])
    assert eng.stats()["sessions_hot"] == 1 and eng.stats()["blocks_used"] == 3  # 99 computed
    turn2 = turn1 + out["t1"] + [1, 2, 3]
    out2, _, _ = run(eng, [SeqSpec("t2", turn2, 5, session_id="chat")])
    assert eng.stats()["prefix_hit_tokens"] == 96
    assert out2["t2"] == dense(model, turn2, 5)
    eng.close()
    assert eng.stats()["blocks_used"] == 0 and warm_count(eng.sessions.session_dir) == 1
    _assert_no_leak(eng)

    # a fresh engine (restart) restores the warm session from disk
    eng2 = PagedEngine(model, num_blocks=32, session_dir=str(tmp_path), model_id="tiny")
    turn3 = turn2 + out2["t2"] + [4, 5]
    out3, _, _ = run(eng2, [SeqSpec("t3", turn3, 5, session_id="chat")])
    st = eng2.stats()
    assert st["session_restores"] == 1 and st["prefix_hit_tokens"] == 96
    assert out3["t3"] == dense(model, turn3, 5)


def test_session_file_of_another_shape_is_ignored_not_fatal(model, tmp_path):
    """A session file written by another model served under the same name (other heads), or one
    whose metadata is damaged, is logged and ignored: the turn runs as if there were none."""
    turn1 = _prompts(13, 1, 80, 80)[0]
    other = PagedEngine(random_llama(1, hidden_size=64, heads=4, kv_heads=4), num_blocks=32,
                        session_dir=str(tmp_path), model_id="tiny")
    out, _, _ = run(other, [SeqSpec("t1", turn1, 20, session_id="chat")])
    other.close()
    assert warm_count(other.sessions.session_dir) == 1
    turn2 = turn1 + out["t1"] + [1, 2, 3]
    eng = PagedEngine(model, num_blocks=32, session_dir=str(tmp_path), model_id="tiny")
    out2, _, _ = run(eng, [SeqSpec("t2", turn2, 5, session_id="chat")])
    assert out2["t2"] == dense(model, turn2, 5) and eng.stats()["session_restores"] == 0
    _assert_no_leak(eng)

    path = eng.sessions.path("chat")
    data, meta = mx.load(path, return_metadata=True)
    for bad in ({**meta, "tokens": "not json"}, {k: v for k, v in meta.items() if k != "tokens"},
                {**meta, "tokens": "[1, 2, 3]"}):
        mx.save_safetensors(path, data, metadata=bad)
        assert eng.sessions.load("chat") is None


def test_session_spill_survives_a_concurrent_spill_and_a_full_disk(model, tmp_path, monkeypatch):
    """Two workers sharing the directory may spill one session at once: each writes its own
    temporary, so both renames succeed. A spill that cannot be written is logged, not raised."""
    from mlxq.worker.engine import sessions as sessions_mod

    eng = PagedEngine(model, num_blocks=32, session_dir=str(tmp_path), model_id="tiny")
    peer = sessions_mod.SessionFiles(str(tmp_path), "tiny", eng.pool)
    run(eng, [SeqSpec("t1", _prompts(14, 1, 80, 80)[0], 20, session_id="chat")])
    real_save, nested = mx.save_safetensors, []

    def save_with_peer_inside(path, data, metadata):
        real_save(path, data, metadata=metadata)
        if not nested:  # the other worker's whole spill lands between this write and its rename
            nested.append(path)
            peer.save("chat", [1] * 32, eng.pool.read_blocks([0]))

    monkeypatch.setattr(sessions_mod.mx, "save_safetensors", save_with_peer_inside)
    eng.close()
    assert nested and eng.sessions.load("chat") is not None
    assert sorted(os.listdir(tmp_path)) == [os.path.basename(eng.sessions.path("chat"))]

    def full_disk(path, data, metadata):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(sessions_mod.mx, "save_safetensors", full_disk)
    eng2 = PagedEngine(model, num_blocks=32, session_dir=str(tmp_path / "d2"), model_id="tiny")
    run(eng2, [SeqSpec("t2", _prompts(15, 1, 80, 80)[0], 5, session_id="other")])
    eng2.close()
    assert eng2.stats()["blocks_used"] == 0 and os.listdir(tmp_path / "d2") == []


def test_sessions_spill_under_pressure(model, tmp_path):
    eng = PagedEngine(model, num_blocks=12, session_dir=str(tmp_path))
    for i in range(3):
        run(eng, [SeqSpec(f"c{i}", _prompts(20 + i, 1, 70, 70)[0], 2, session_id=f"c{i}")])
    # a big job forces the hot sessions out to disk instead of waiting forever
    out, _, _ = run(eng, [SeqSpec("big", _prompts(30, 1, 250, 250)[0], 2)])
    assert eng.stats()["session_spills"] >= 1 and warm_count(eng.sessions.session_dir) >= 1
    _assert_no_leak(eng)


def test_no_leak_after_mixed_load(model):
    eng = PagedEngine(model, num_blocks=40, pressure=0.85, chunk_schedule=SMALL_CHUNKS)
    rng = random.Random(0)
    system = _prompts(40, 1, 64, 64)[0]
    specs = []
    for i in range(16):
        p = (system if i % 2 else []) + _prompts(50 + i, 1, 1, 80)[0]
        specs.append(SeqSpec(f"x{i}", p, rng.randint(1, 25), priority=float(rng.randint(0, 3))))
    base = eng.stats()["blocks_free"]
    eng.add(specs[:3])
    eng.step()
    eng.remove(["x1"])  # cancelled mid-flight
    out, _, _ = run(eng, specs[3:], added=specs[:3])
    st = eng.stats()
    assert st["blocks_used"] == 0 and st["blocks_cached"] + st["blocks_free"] == base
    _assert_no_leak(eng)


def test_oversized_job_is_capped_not_stuck(model):
    eng = PagedEngine(model, num_blocks=4)
    assert not eng.can_admit(10, 500)
    out, done, n_pre = run(eng, [SeqSpec("big", list(range(1, 11)), 500)])
    assert done["big"] == "length" and len(out["big"]) == 3 * 32 - 10 and n_pre == 0
    assert out["big"] == dense(model, list(range(1, 11)), 86)
    _assert_no_leak(eng)
