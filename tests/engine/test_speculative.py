"""Speculative decoding (prompt lookup, a draft model): the output is the non-speculative engine's,
token for token, greedy and seeded alike, alone and in a mixed batch, constrained, across a resume,
a preemption, a cancel, a stop id and a stop string; rejected positions give their blocks back and
never reach the prefix cache.  Most tests speculate at every step (``_always``): the step-time
policy is tested on its own with fixed times.  (Speed is bench/speculative.py's.)"""

from dataclasses import replace

import pytest

from mlxq.shared.schemas import SamplingParams
from mlxq.worker.engine import PagedEngine
from mlxq.worker.engine.api import SeqSpec
from mlxq.worker.engine.sampler import make_sampler
from mlxq.worker.engine.speculative import ACCEPT_PRIOR, Drafting, NgramIndex, StepCosts

from enginekit import SMALL_CHUNKS, _assert_no_leak, _prompts, random_llama, run

BASE = _prompts(1, 1, 40, 40)[0]
# prompts whose continuations repeat their spans (the random model loops: proposals are accepted),
# and one that does not
PROMPTS = [BASE * 3, BASE[:20] * 4 + [7], _prompts(2, 1, 30, 30)[0], list(range(50))]
LENS = [40, 33, 25, 17]


@pytest.fixture(scope="module")
def model():
    return random_llama(3)


def _always(eng):
    """Every row that has a proposal speculates at every step (the step-time policy out of the way,
    so the tests do not depend on how fast steps run)."""
    eng.speculator.costs.always = True
    return eng


def _pair(model, specs, model_file=False, **kw):
    """The outputs of ``specs`` (made afresh for each engine by the callable) without and with
    speculation, and the speculating engine; ``model_file``: that engine runs the model file (its
    verify passes a padded batch) instead of the decode forward (a decode row per position)."""
    outs, eng = [], None
    for mode in ("off", "ngram"):
        eng = PagedEngine(model, num_blocks=64, speculate=mode, **kw)
        if mode == "ngram":
            _always(eng)
            if model_file:
                eng.runner.decode_forward = None
            assert eng.runner.verify_pads() == model_file
        out, done, _ = run(eng, specs())
        outs.append((out, done))
        _assert_no_leak(eng)
        _cache_holds_only_emitted(eng, specs(), out)
    return outs[0], outs[1], eng


def _cache_holds_only_emitted(eng, specs, out):
    """Every block in the prefix cache holds a block of some job's prompt and output (never a
    rejected proposal's tokens)."""
    bs = eng.bm.block_size
    real = {tuple(t[i:i + bs]) for s in specs for t in [s.prompt + out[s.uid]] for i in range(0, len(t) - bs + 1, bs)}
    cached = [b.tokens for b in eng.bm.blocks if b.hash is not None]
    assert cached and all(t in real for t in cached)


def _greedy():
    return [SeqSpec(f"g{i}", p, n) for i, (p, n) in enumerate(zip(PROMPTS, LENS))]


def _seeded(start=0, resume=None, n=None):
    specs = []
    for i, (p, m) in enumerate(zip(PROMPTS, LENS)):
        params = SamplingParams(temperature=0.7, seed=10 + i)
        specs.append(SeqSpec(f"r{i}", p, n or m, sampler=make_sampler(params, 10 + i, start_step=start),
                             resume_tokens=list(resume or [])))
    return specs


@pytest.mark.parametrize("model_file", [False, True], ids=["decode-forward", "model-file"])
def test_greedy_identical_solo_and_in_a_mixed_batch(model, model_file):
    for specs in (lambda: _greedy()[:1], _greedy):
        (off, off_done), (on, on_done), eng = _pair(model, specs, model_file)
        assert on == off and on_done == off_done
        st = eng.stats()
        assert st["verify_passes"] > 0 and st["draft_accepted"] > 0
        assert st["decode_passes"] < sum(LENS[:len(specs())])  # accepted runs made steps fewer


def test_mixed_rows_penalties_bias_and_processors(model):
    """Rows that shape their logits (penalties over the proposal's tokens too, a bias) speculate;
    a row with a logits processor feeds its one token in the same pass."""
    def specs():
        g = _greedy()
        return [replace(g[0], presence_penalty=0.5, repetition_penalty=1.1),
                replace(g[1], logit_bias={3: 2.0}),
                replace(g[2], logits_processors=[lambda ctx, x: x]), g[3]]

    (off, _), (on, _), eng = _pair(model, specs)
    assert on == off and eng.stats()["draft_accepted"] > 0


def test_seeded_sampling_identical_and_resumes_at_its_step(model):
    (off, _), (on, _), eng = _pair(model, _seeded)
    assert on == off and eng.stats()["draft_accepted"] > 0
    # a crash after 9 tokens: the job comes back with them as resume tokens and its sampler at step 9
    eng = _always(PagedEngine(model, num_blocks=64, speculate="ngram"))
    resumed = [replace(s, resume_tokens=off[s.uid][:9], max_tokens=s.max_tokens - 9,
                       sampler=make_sampler(SamplingParams(temperature=0.7, seed=10 + i), 10 + i, start_step=9))
               for i, s in enumerate(_seeded())]
    out, _, _ = run(eng, resumed)
    assert out == off


def test_preemption_under_speculation_resumes_identically(model):
    """A pool of 12 blocks for 10 jobs of mixed priorities: sequences are preempted (some right
    after a verify pass) and come back with their tokens; greedy, seeded and penalized alike."""
    def specs():
        out = []
        for i in range(10):
            p = BASE[:5 + 4 * i] * 2 if i % 2 else _prompts(100 + i, 1, 5, 60)[0]
            params = SamplingParams(temperature=0.8, seed=1000 + i)
            out.append(SeqSpec(f"j{i}", p, 12 + 3 * i, priority=float(i % 3),
                               sampler=make_sampler(params, 1000 + i) if i % 3 == 0 else None,
                               presence_penalty=0.3 if i % 4 == 1 else 0.0))
        return out

    outs = []
    for mode in ("off", "ngram"):
        eng = PagedEngine(model, num_blocks=12, pressure=1.0, chunk_schedule=SMALL_CHUNKS, speculate=mode)
        if mode == "ngram":
            _always(eng)
        out, done, preempted = run(eng, specs())
        _assert_no_leak(eng)
        outs.append((out, done))
    assert outs[0] == outs[1]
    assert preempted > 0 and eng.stats()["draft_accepted"] > 0


def test_stop_token_inside_an_accepted_run(model):
    (off, _), _, _ = _pair(model, lambda: _greedy()[:1])
    ref = off["g0"]
    stop = ref[25]
    cut = ref[:ref.index(stop) + 1]
    (o1, d1), (o2, d2), _ = _pair(model, lambda: _greedy()[:1], eos_token_ids=[stop])
    assert o1 == o2 == {"g0": cut} and d1 == d2 == {"g0": "stop"}


def test_cancel_mid_speculation_and_blocks_back_to_baseline(model):
    eng = _always(PagedEngine(model, num_blocks=64, speculate="ngram"))
    free = eng.stats()["blocks_free"]
    specs = _greedy()
    eng.add(specs)
    prior = {s.uid: [] for s in specs}
    while eng.stats()["verify_passes"] == 0:
        for e in eng.step()[0]:
            prior[e.uid].append(e.token)
    eng.remove(["g0"])
    out, _, _ = run(eng, [], added=specs[1:], prior=prior)
    ref, _, _ = run(PagedEngine(model, num_blocks=64), _greedy()[1:])
    assert {k: v for k, v in out.items() if k != "g0"} == ref
    st = eng.stats()
    assert st["blocks_used"] == 0 and st["blocks_free"] + st["blocks_cached"] == free
    _assert_no_leak(eng)


def test_auto_speculates_only_where_a_rows_bits_do_not_follow_its_batch(model):
    # the default: prompt lookup where the matmuls are the extension's own loops (as on these CPUs, or
    # the engine tests' outputs would not all be compared under speculation); MLX's matmul: off
    assert PagedEngine(model, num_blocks=8).speculate == "ngram"
    assert PagedEngine(model, num_blocks=8, matmul="mlx").speculator is None
    assert PagedEngine(model, num_blocks=8, matmul="mlx", speculate="ngram").speculate == "ngram"  # asked for


def test_ngram_index_proposes_the_latest_longest_match():
    idx = NgramIndex()
    toks = [1, 2, 3, 9, 1, 2, 3, 4, 5, 7, 2, 3]
    assert idx.propose(toks, 3) == [4, 5, 7]  # "2 3" last followed by 4 (the 3-gram "7 2 3" is new)
    assert idx.propose(toks + [8], 2) == []
    assert idx.propose(toks + [8, 1], 2) == [2, 3]
    fresh = NgramIndex()  # a row's tokens only grow
    assert [fresh.match(toks + t) for t in ([], [8], [8, 1], [8, 1, 2])] == [2, 0, 1, 2]


def test_a_rows_rate_is_kept_per_cue():
    # a copied span (cue 3) accepts where one-token matches (cue 1) do not: each verdict moves the rate
    # of the cue its step was picked on, and a step reads the rate of its own cue
    d = Drafting()
    for cue, accepted in [(1, 0), (3, 4), (1, 0), (3, 4)]:
        d.cue = cue
        d.verdict(4, accepted, 8)
    assert d.rates[1] < ACCEPT_PRIOR < d.rates[3] and d.rates[0] == d.rates[2] == ACCEPT_PRIOR
    d.cue = 1
    assert d.rate == d.rates[1]


def test_step_costs_turn_speculation_off_when_extra_positions_cost_more():
    batch = StepCosts()  # a batch of 16: 8 ms a step, 0.5 ms a position, and a verify step loses 2 ms
    for i in range(8):
        batch.record(False, 16 + i % 2, 0.008 + 0.0005 * (16 + i % 2))
        batch.record(True, 30 + i, 0.008 + 0.0005 * (30 + i) + 0.002)
    # 12 of 16 rows propose 2 tokens: every row computes 3 positions (padded), for 3.75 more tokens
    # at a 25% acceptance (a loss), or 22.2 more at 95% (a win, at the longer cap)
    assert batch.choose(16, [(2, 0.25)] * 12) == ([], 0)
    assert batch.choose(16, [(2, 0.95)] * 12) == (list(range(12)), 2)
    # 4 rows of 16 with a good proposal: a padded pass computes 48 positions for 7.4 more tokens (a
    # loss), one with each row's own positions 24 (a win)
    assert batch.choose(16, [(2, 0.95)] * 4) == ([], 0)
    assert batch.choose(16, [(2, 0.95)] * 4, padded=False) == (list(range(4)), 2)
    solo = StepCosts()  # solo: a step reads the weights, a position is almost free
    for i in range(8):
        solo.record(False, 1, 0.010)
        solo.record(True, 2 + i % 4, 0.0105 + 0.0002 * (i % 4))
    assert solo.choose(1, [(4, 1.0)]) == ([0], 4)
    assert solo.choose(1, [(4, 0.01)]) == ([], 0)


def test_constrained_output_identical_and_proposals_cut_by_the_grammar(tiny_model):
    from mlxq.shared.constraints import compile_format

    tok = tiny_model.tokenizer
    listing = "yes-12 no-345 maybe-77 yes-12 no-345 maybe-77 yes-12"
    regex = compile_format({"type": "regex", "pattern": r"((yes|no|maybe)-[0-9]{2,4} ){6}"})
    schema = compile_format({"type": "json_schema", "json_schema": {"name": "x", "strict": True, "schema": {
        "type": "object", "properties": {"names": {"type": "array", "items": {"enum": ["Ada", "Bob", "Cy"]}}},
        "required": ["names"], "additionalProperties": False}}})
    prompts = [tok.encode(f"Copy: {listing}\n"), tok.encode('Names: {"names": ["Ada", "Bob", "Cy", "Ada"]}\n')]

    def specs():
        params = SamplingParams(temperature=0.8, seed=5)
        return [SeqSpec("re", prompts[0], 40, grammar=regex), SeqSpec("js", prompts[1], 40, grammar=schema),
                SeqSpec("re-seeded", prompts[0], 40, grammar=regex, sampler=make_sampler(params, 5)),
                SeqSpec("free", prompts[0], 30)]

    outs = []
    for mode in ("off", "ngram"):
        eng = PagedEngine(tiny_model.model, num_blocks=64, speculate=mode, eos_token_ids=tiny_model.eos_token_ids,
                          tokenizer=tok)
        if mode == "ngram":
            _always(eng)
        outs.append(run(eng, specs())[:2])
        _assert_no_leak(eng)
    assert outs[0] == outs[1]
    assert eng.stats()["draft_proposed"] > 0
    grammar = eng.runner.book.start(regex, [])
    yes = tok.encode("yes-12 ", add_special_tokens=False)
    assert grammar.allowed_prefix(yes + yes + tok.encode("hello", add_special_tokens=False)) == yes + yes


def test_draft_model_proposals_verified_identically(model):
    """A draft model (its own paged KV, the same vocabulary): the same weights as the target accept
    every greedy proposal; another random model's are mostly rejected; the output is the same."""
    other = random_llama(9, hidden_size=32)
    refs = {specs: run(PagedEngine(model, num_blocks=64), specs())[0] for specs in (_greedy, _seeded)}
    for draft, name in ((model, "the target's own weights"), (other, "another random model")):
        for specs, ref in refs.items():
            eng = _always(PagedEngine(model, num_blocks=64, speculate="draft", draft=draft))
            out, _, _ = run(eng, specs())
            assert out == ref
            _assert_no_leak(eng)
            st = eng.stats()
            print(f"draft model, {name}, {specs.__name__[1:]}: {st['draft_accepted']}/{st['draft_proposed']} accepted")
            if draft is model and specs is _greedy:
                assert st["draft_accepted"] == st["draft_proposed"] > 0
    with pytest.raises(ValueError, match="draft model"):
        PagedEngine(model, num_blocks=64, speculate="draft")


def test_worker_engine_loads_its_draft_model(tiny_model, tiny_model_dir):
    """``--speculate draft --draft-model PATH`` through the worker's settings: loaded as the model is,
    its tokenizer checked (here: the tiny model drafts for itself, so greedy proposals all pass)."""
    from mlxq.shared.settings import Settings
    from mlxq.worker.engine.engine import make_engine

    small = dict(kv_blocks=64, huge_pages=False)
    eng = _always(make_engine(tiny_model, Settings(speculate="draft", draft_model=str(tiny_model_dir), **small)))
    prompt = tiny_model.tokenizer.encode("Once upon a time")
    out, _, _ = run(eng, [SeqSpec("d", prompt, 12, stop_token_ids=())])
    ref, _, _ = run(make_engine(tiny_model, Settings(**small)), [SeqSpec("d", prompt, 12, stop_token_ids=())])
    st = eng.stats()
    assert out == ref and st["draft_accepted"] == st["draft_proposed"] > 0


def test_stop_string_inside_an_accepted_run_through_the_worker(tiny_model, redis_url):
    """The worker cuts the text at a stop string that falls inside a step's run of tokens (the tiny
    model drafts for itself: every greedy proposal is accepted, several tokens a step)."""
    from mlxq import Client
    from workerkit import fast_settings, running_worker

    engine = _always(PagedEngine(tiny_model.model, num_blocks=64, eos_token_ids=tiny_model.eos_token_ids,
                                 tokenizer=tiny_model.tokenizer, model_id="tiny", speculate="draft",
                                 draft=tiny_model.model))
    settings = fast_settings(redis_url)
    client = Client(redis_url, model="tiny", settings=settings)
    prompt = tiny_model.tokenizer.encode("Once upon a time")
    with running_worker(tiny_model, redis_url, settings, engine=engine):
        text = client.submit(prompt_tokens=prompt, max_tokens=24, ignore_eos=True).result(timeout=60).text
        stop = text[len(text) // 2:len(text) // 2 + 3]
        res = client.submit(prompt_tokens=prompt, max_tokens=24, ignore_eos=True, stop=[stop]).result(timeout=60)
    assert (res.finish_reason, res.text) == ("stop", text[:text.index(stop)])
    assert res.stats.draft_accepted > 0
