"""n > 1 samples of one job on shared blocks: one prefill of the prompt, the sibling's full blocks
shared, its last partial block copied; each sample's tokens its own and reproducible."""

from dataclasses import replace

import pytest

from mlxq.shared.schemas import SamplingParams
from mlxq.worker.engine import PagedEngine
from mlxq.worker.engine.block_manager import BlockManager
from mlxq.shared.engine_config import EngineConfig
from mlxq.worker.engine.scheduler import Scheduler
from mlxq.worker.engine.sequence import Sampled, SequenceStatus
from mlxq.worker.engine.sampler import RowSampler
from mlxq.worker.engine.api import SeqSpec

from enginekit import SMALL_CHUNKS, _assert_no_leak, _llama, _prompts, dense

PARAMS = SamplingParams(temperature=0.9, top_p=0.9, seed=7)


@pytest.fixture(scope="module")
def model():
    return _llama()


def job(uid, prompt, n, max_tokens, seeded=False, fork=True, **kw):
    """The n sequences of one job, as the worker builds them (``uid#i``, forking off sample 0)."""
    return [SeqSpec(f"{uid}#{i}", list(prompt), max_tokens, sampler=_sampler(i) if seeded else None,
                    fork_of=f"{uid}#0" if fork and i else None, fork_len=len(prompt) if fork else 0, **kw)
            for i in range(n)]


def _sampler(sample, start_step=0):
    return RowSampler(PARAMS, PARAMS.seed, start_step, sample=sample) if sample is not None else None


def drive(engine, specs, arrivals=None, on_step=None, max_steps=2000):
    """Run to completion; a preempted sequence comes back with its resume tokens and its sampler at
    that step (as the worker requeues it).  ``arrivals``: {step: [specs]} added later."""
    orig = {s.uid: s for s in list(specs) + [s for v in (arrivals or {}).values() for s in v]}
    out = {uid: [] for uid in orig}
    engine.add(list(specs))
    for step in range(max_steps):
        engine.add((arrivals or {}).get(step, []))
        if not engine.has_work():
            break
        events, preempted = engine.step()
        for e in events:
            out[e.uid].append(e.token)
        for p in preempted:
            s = orig[p.uid]
            sample = int(p.uid.rpartition("#")[2]) if s.sampler is not None else None
            engine.add([replace(s, resume_tokens=list(p.tokens), max_tokens=s.max_tokens - len(p.tokens),
                                sampler=_sampler(sample, len(p.tokens)))])
        if on_step:
            on_step(step)
    assert not engine.has_work()
    return out


def test_scheduler_plans_the_copy_and_pins_its_source_until_then():
    """The plan, on its own (block size 4): a 10-token prompt is 2 shared full blocks + a copied one
    (the fork given no first token by the pass: a constrained one, which computes its last prompt token)."""
    s = Scheduler(BlockManager(32, 4, "m"), EngineConfig())
    s.add(job("j", list(range(1, 11)), 2, 5, stop_token_ids=()))
    plan = s.schedule_prefill()
    assert [q.uid for q, _ in plan.rows] == ["j#0"] and not plan.copies
    assert [q.uid for q in s.waiting] == ["j#1"]  # waits for its sibling's prefill, holding nothing
    s.postprocess_prefill(plan, [Sampled(q, 7) for q in plan.ending_seqs()])
    plan = s.schedule_prefill()
    j0, j1 = s.running["j#0"], s.running["j#1"]
    assert plan.rows == [] and plan.copies == [(j0.block_table[2], j1.block_table[2])]
    assert j1.block_table[:2] == j0.block_table[:2] and j1.block_hashes == j0.block_hashes[:2]
    assert j1.status is SequenceStatus.DECODE and j1.num_computed == 9  # its decode row computes token 10
    # shared blocks counted once; the copy's source is no longer pinned once the plan carries it
    assert [s.bm.blocks[b].ref_count for b in j1.block_table] == [2, 2, 1]
    assert s.bm.blocks[j0.block_table[2]].ref_count == 1 and s.bm.num_used == 3 + 1
    s.remove(["j"])
    assert s.bm.num_used == 0 and not s.running and not s.waiting


def test_waiting_forks_draw_their_first_token_from_the_siblings_last_prefill_pass():
    """The pass that ends sample 0's prompt samples every waiting fork's first token from sample
    0's logits; next step the forks share the whole prompt (the partial block copied) and decode."""
    s = Scheduler(BlockManager(32, 4, "m"), EngineConfig())
    s.add(job("j", list(range(1, 11)), 3, 5, stop_token_ids=()))
    plan = s.schedule_prefill()
    assert [q.uid for q, _ in plan.rows] == ["j#0"]
    assert [(w.uid, k) for w, k in plan.firsts] == [("j#1", 0), ("j#2", 0)]
    s.postprocess_prefill(plan, [Sampled(q, 7 + i) for i, q in enumerate(plan.ending_seqs() + [w for w, _ in plan.firsts])])
    assert [(e.uid, e.token) for e in s.take_output()[0]] == [("j#0", 7), ("j#1", 8), ("j#2", 9)]
    plan = s.schedule_prefill()
    j0, j1, j2 = s.running["j#0"], s.running["j#1"], s.running["j#2"]
    assert plan.rows == [] and plan.copies == [(j0.block_table[2], j1.block_table[2]),
                                               (j0.block_table[2], j2.block_table[2])]
    assert j1.status is SequenceStatus.DECODE and j1.num_computed == 10 and j1.tokens[-1] == 8
    assert s.counters.fork_shared_tokens == 20 and s.counters.prompt_tokens == 10
    rows = s.schedule_decode()
    assert {q.uid for q in rows} == {"j#0", "j#1", "j#2"}  # all three decode together
    s.remove(["j"])
    assert s.bm.num_used == 0 and not s.running and not s.waiting


def test_a_fork_that_ends_on_its_first_token_leaves_the_queue():
    s = Scheduler(BlockManager(32, 4, "m"), EngineConfig())
    specs = job("j", list(range(1, 11)), 3, 5, stop_token_ids=(99,))
    specs[2] = replace(specs[2], max_tokens=1)
    s.add(specs)
    plan = s.schedule_prefill()
    s.postprocess_prefill(plan, [Sampled(q, t) for q, t in zip(plan.ending_seqs() + [w for w, _ in plan.firsts],
                                                                (7, 99, 5))])
    assert [(e.uid, e.token, e.finish_reason) for e in s.take_output()[0]] == [
        ("j#0", 7, None), ("j#1", 99, "stop"), ("j#2", 5, "length")]
    assert not s.waiting and set(s.running) == {"j#0"}
    s.remove(["j"])
    assert s.bm.num_used == 0
    # a first token the runner could not sample (a dead constraint) ends the fork with "error"
    s.add(job("k", list(range(1, 11)), 2, 5, stop_token_ids=()))
    plan = s.schedule_prefill()
    (w, _), = plan.firsts
    s.postprocess_prefill(plan, [Sampled(plan.ending_seqs()[0], 7), Sampled(w, None, error="dead end")])
    assert [(e.uid, e.token, e.finish_reason, e.error) for e in s.take_output()[0]] == [
        ("k#0", 7, None, None), ("k#1", None, "error", "dead end")]
    assert not s.waiting and set(s.running) == {"k#0"}
    s.remove(["k"])
    assert s.bm.num_used == 0


def test_a_fork_with_no_room_behind_a_more_urgent_job_waits_and_pins_nothing():
    """priority_gap 0: a job only a little more urgent goes first; the fork waits, with no copy and no
    pin on its sibling's blocks. (A job of the same priority that arrives later no longer preempts
    the fork admitted before it: the two preempted each other for ever; test_scheduler.py.)"""
    s = Scheduler(BlockManager(9, 4, "m"), EngineConfig(priority_gap=0.0, pressure=1.0))
    s.add(job("j", list(range(1, 11)), 2, 5, stop_token_ids=()))
    plan = s.schedule_prefill()
    s.postprocess_prefill(plan, [Sampled(q, 7) for q in plan.ending_seqs()])
    s.add([SeqSpec("x", [3] * 20, 1, priority=-0.5, stop_token_ids=())])
    plan = s.schedule_prefill()
    assert [q.uid for q, _ in plan.rows] == ["x"] and plan.copies == []
    assert s.take_output()[1] == [] and [q.uid for q in s.waiting] == ["j#1"]
    j0 = s.running["j#0"]
    assert [s.bm.blocks[b].ref_count for b in j0.block_table] == [1, 1, 1]  # the pin is gone too
    assert s.bm.num_used == 3 + 5
    s.bm.check_invariants()


def test_forked_greedy_samples_equal_solo_one_prefill_shared_blocks(model):
    prompt = _prompts(11, 1, 70, 70)[0]  # 2 full blocks + 6 tokens
    eng = PagedEngine(model, num_blocks=64)
    used = []

    def on_step(step):
        if len(eng.scheduler.running) == 4 and not used:
            used.append(eng.bm.num_used)

    out = drive(eng, job("j", prompt, 4, 12), on_step=on_step)
    ref = dense(model, prompt, 12)
    assert out == {f"j#{i}": ref for i in range(4)}
    # the prompt's 3 blocks once, plus one copied partial block per forked sample (70 + 12 < 96: no growth)
    assert used == [3 + 3]
    st = eng.stats()
    assert eng.counters.prefill_tokens == len(prompt)  # computed once, the forks' last token too
    assert st["fork_shared_tokens"] == 3 * len(prompt)
    assert st["prompt_tokens"] == len(prompt)
    _assert_no_leak(eng)
    # the prompt's full blocks stay in the prefix cache for the next job
    assert drive(eng, [SeqSpec("again", prompt, 4)]) == {"again": ref[:4]}
    assert eng.stats()["prefix_hit_tokens"] == 64
    # without fork_of the same samples prefill 4 times (and give the same tokens)
    eng2 = PagedEngine(model, num_blocks=64)
    assert drive(eng2, job("j", prompt, 4, 12, fork=False)) == out
    assert eng2.counters.prefill_tokens == 4 * len(prompt)


def test_the_fork_copy_writes_the_pool_in_place(model):
    """The forks' copies of the sibling's partial block go through the in-place KV writer: every
    pool array keeps its buffer (MLX's scatter copied a whole layer array when a queued step
    still held it) and the writer copied nothing."""
    from mlxq.worker.engine import attention
    from mlxq.worker.engine.hugepages import _span

    ext = attention.cpu_extension()
    eng = PagedEngine(model, num_blocks=64)
    assert eng.pool.kv_write is not None
    buffers = [_span(a)[0] for a in eng.pool.arrays()]
    copies = ext.kv_write_copies()
    prompt = _prompts(12, 1, 70, 70)[0]
    assert drive(eng, job("j", prompt, 4, 6)) == {f"j#{i}": dense(model, prompt, 6) for i in range(4)}
    assert [_span(a)[0] for a in eng.pool.arrays()] == buffers
    assert ext.kv_write_copies() == copies


def test_all_samples_get_their_first_token_in_the_prefill_step(model):
    """The pass that ends sample 0's prompt gives every sample its first token (from sample 0's
    logits, each with its own sampler); the samples then decode in the same steps and end together."""
    prompt = _prompts(16, 1, 70, 70)[0]
    eng = PagedEngine(model, num_blocks=64, chunk_schedule=SMALL_CHUNKS)
    eng.add(job("j", prompt, 4, 10, seeded=True))
    first: dict = {}
    last: dict = {}
    for step in range(200):
        if not eng.has_work():
            break
        for e in eng.step()[0]:
            first.setdefault(e.uid, step)
            last[e.uid] = step
    assert len(set(first.values())) == 1 and len(set(last.values())) == 1
    assert eng.counters.prefill_tokens == len(prompt) and eng.stats()["fork_shared_tokens"] == 3 * len(prompt)
    _assert_no_leak(eng)


def test_seeded_samples_reproducible_alone_batched_and_preempted(model):
    prompt = _prompts(12, 1, 40, 40)[0]
    alone = drive(PagedEngine(model, num_blocks=64), job("s", prompt, 4, 30, seeded=True))
    assert len({tuple(t) for t in alone.values()}) == 4  # each sample draws its own tokens
    # sample 0 is the one-sample job with the same seed; unforked samples give the same tokens
    one = SeqSpec("one", list(prompt), 30, sampler=RowSampler(PARAMS, PARAMS.seed))
    assert drive(PagedEngine(model, num_blocks=64), [one])["one"] == alone["s#0"]
    assert drive(PagedEngine(model, num_blocks=64), job("s", prompt, 4, 30, seeded=True, fork=False)) == alone
    # in a batch with other jobs (greedy, another seeded job) arriving before and after
    others = [SeqSpec("g", [5] * 50, 30)] + job("t", [9, 8, 7], 2, 20, seeded=True)
    out = drive(PagedEngine(model, num_blocks=64, chunk_schedule=SMALL_CHUNKS), others[:1],
                arrivals={2: job("s", prompt, 4, 30, seeded=True), 5: others[1:]})
    assert {u: out[u] for u in alone} == alone
    # preempted mid-run by an urgent job, resumed from resume_tokens (forking again where it can)
    # speculation off: the test needs the preemption a one-token-a-step schedule gives
    eng = PagedEngine(model, num_blocks=9, pressure=1.0, speculate="off")
    urgent = SeqSpec("u", [1] * 100, 3, priority=0.0)
    out = drive(eng, job("s", prompt, 4, 30, seeded=True, priority=5.0), arrivals={8: [urgent]})
    assert eng.stats()["preemptions"] > 0
    assert {u: out[u] for u in alone} == alone
    _assert_no_leak(eng)


def test_cancelling_the_job_frees_every_sample(model):
    prompt = _prompts(13, 1, 100, 100)[0]
    for steps in (1, 6):  # while sample 0 prefills (the others wait), and once all decode
        eng = PagedEngine(model, num_blocks=64, chunk_schedule=SMALL_CHUNKS)
        eng.add(job("c", prompt, 4, 200) + [SeqSpec("other", [3] * 20, 200)])
        for _ in range(steps):
            eng.step()
        assert (len(eng.scheduler.running) == 5) == (steps == 6)
        eng.remove(["c"])  # the bare job id takes its samples along
        assert set(eng.scheduler.running) == {"other"} and not eng.scheduler.waiting
        eng.remove(["other"])
        assert not eng.has_work() and eng.bm.num_used == 0
        _assert_no_leak(eng)


def test_waiting_samples_do_not_fill_the_engines_queue(model):
    """Samples waiting for their sibling's prefill wait for no memory: the worker keeps pulling."""
    eng = PagedEngine(model, num_blocks=64, max_waiting=2, chunk_schedule=SMALL_CHUNKS)
    eng.add(job("w", _prompts(15, 1, 100, 100)[0], 6, 4))
    eng.step()
    assert len(eng.scheduler.waiting) == 5 and eng.free_slots() > 0
    eng.remove(["w"])
    _assert_no_leak(eng)


def test_fork_falls_back_when_the_sibling_is_gone(model):
    prompt = _prompts(14, 1, 70, 70)[0]
    ref = dense(model, prompt, 8)
    # sample 0 ends in its prefill step (max_tokens 1): the others admit on their own (prefix cache)
    eng = PagedEngine(model, num_blocks=64)
    specs = job("f", prompt, 3, 8)
    specs[0] = replace(specs[0], max_tokens=1)
    out = drive(eng, specs)
    assert out["f#0"] == ref[:1] and out["f#1"] == out["f#2"] == ref
    assert eng.stats()["fork_shared_tokens"] == 0
    # sample 0 cancelled while the others wait for its prefill; a sibling that never comes
    eng = PagedEngine(model, num_blocks=64, chunk_schedule=SMALL_CHUNKS)
    eng.add(job("f", prompt, 3, 8) + [replace(job("h", prompt, 2, 8)[1], uid="lonely")])
    got: dict = {}
    for step in range(200):
        if step == 1:
            assert [s.uid for s in eng.scheduler.waiting] == ["f#1", "f#2"]  # "lonely" did not wait
            eng.remove(["f#0"])
        if not eng.has_work():
            break
        for e in eng.step()[0]:
            got.setdefault(e.uid, []).append(e.token)
    assert got == {"f#1": ref, "f#2": ref, "lonely": ref}
    _assert_no_leak(eng)


def test_bad_fork_fields_are_ignored(model):
    prompt = [4, 5, 6, 7]
    specs = [SeqSpec("b#0", prompt, 4), SeqSpec("b#1", prompt, 4, fork_of="b#0", fork_len=9),
             SeqSpec("b#2", prompt, 4, fork_of="b#2", fork_len=4)]
    out = drive(PagedEngine(model, num_blocks=16), specs)
    assert out == {s.uid: dense(model, prompt, 4) for s in specs}


@pytest.mark.parametrize("bits", [8, 4])
def test_forks_copy_quantized_blocks(bits):
    """With quantized KV blocks the copied partial block carries its scales and biases too: forked
    greedy samples equal the same prompt run alone on the same quantized pool."""
    from enginekit import random_llama

    model = random_llama(5, hidden_size=128)  # head dim 32: one 32-wide quantization group
    prompt = _prompts(11, 1, 70, 70)[0]
    alone = drive(PagedEngine(model, num_blocks=64, kv_bits=bits, kv_group_size=32), [SeqSpec("solo", prompt, 12)])["solo"]
    eng = PagedEngine(model, num_blocks=64, kv_bits=bits, kv_group_size=32)
    out = drive(eng, job("j", prompt, 4, 12))
    assert out == {f"j#{i}": alone for i in range(4)}
    assert eng.counters.prefill_tokens == len(prompt)
    _assert_no_leak(eng)
