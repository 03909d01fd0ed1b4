"""Embedding sequences in the paged engine: prefill only, the final hidden states pooled (last token
or mean), cut to ``dimensions`` and normalised; batched with other sequences, in priority order."""

import mlx.core as mx
import numpy as np
import pytest

from mlxq.worker.engine import PagedEngine
from mlxq.worker.engine.api import EmbedSpec, SeqSpec

from enginekit import SMALL_CHUNKS, _assert_no_leak, _gemma3, _llama, _prompts, dense

LENGTHS = [(3, 3), (17, 17), (40, 40), (70, 70), (9, 9)]  # short, within a chunk, over several chunks


@pytest.fixture(scope="module")
def model():
    return _llama()


@pytest.fixture(scope="module")
def prompts():
    return [p for i, (lo, hi) in enumerate(LENGTHS) for p in _prompts(10 + i, 1, lo, hi)]


def embed_all(engine, specs, arrivals=None):
    """Step ``engine`` over ``specs`` (and ``arrivals``: {step: [SeqSpec]}) until it is idle; the
    embeddings by uid, generated tokens by uid, and the uids in the order they ended."""
    vecs, toks, order = {}, {}, []
    engine.add(specs)
    step = 0
    while engine.has_work() or any(k >= step for k in (arrivals or {})):
        engine.add((arrivals or {}).get(step, []))
        events, preempted = engine.step()
        assert not preempted
        for ev in events:
            assert ev.finish_reason != "error", ev.error
            if ev.embedding is not None:
                vecs[ev.uid] = np.frombuffer(ev.embedding, dtype="<f4")
            elif ev.token is not None:
                toks.setdefault(ev.uid, []).append(ev.token)
            if ev.finish_reason:
                order.append(ev.uid)
        step += 1
    _assert_no_leak(engine)
    return vecs, toks, order


def _engine(model, **kw):
    return PagedEngine(model, num_blocks=64, chunk_schedule=SMALL_CHUNKS, step_token_budget=40, **kw)


def _spec(uid, prompt, pooling="last", **kw):
    return SeqSpec(uid, prompt, 1, embed=EmbedSpec(pooling=pooling, **kw))


def reference(model, prompt, pooling, dimensions=None):
    """The same vector from plain mlx-lm: the model's final hidden states, pooled, cut, normalised."""
    h = model.model(mx.array([prompt]))[0].astype(mx.float32)
    v = np.array(h[-1] if pooling == "last" else h.mean(axis=0))
    v = v[:dimensions] if dimensions else v
    return v / np.linalg.norm(v)


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_batched_equals_solo_exactly_and_matches_mlx(model, prompts, pooling):
    """Texts of different lengths embedded together (chunked, beside a generating sequence) give the
    very bits each gives alone, and the vector plain mlx-lm's hidden states make."""
    specs = [_spec(f"e{i}", p, pooling) for i, p in enumerate(prompts)]
    gen = SeqSpec("gen", prompts[2], 6)
    batched, toks, _ = embed_all(_engine(model), specs + [gen])
    assert toks["gen"] == dense(model, gen.prompt, 6)  # a generating neighbour is not disturbed
    for spec in specs:
        solo, _, _ = embed_all(_engine(model), [spec])
        assert batched[spec.uid].tobytes() == solo[spec.uid].tobytes(), spec.uid
        assert batched[spec.uid].shape == (model.args.hidden_size,)
        np.testing.assert_allclose(batched[spec.uid], reference(model, spec.prompt, pooling), atol=2e-5)


def test_dimensions_cut_then_normalise(model, prompts):
    vecs, _, _ = embed_all(_engine(model), [_spec("d", prompts[1], dimensions=16),
                                            _spec("raw", prompts[1], normalize=False)])
    assert vecs["d"].shape == (16,)
    np.testing.assert_allclose(np.linalg.norm(vecs["d"]), 1.0, rtol=1e-5)
    np.testing.assert_allclose(vecs["d"], vecs["raw"][:16] / np.linalg.norm(vecs["raw"][:16]), rtol=1e-5)


def test_an_urgent_embedding_goes_before_queued_ones(model, prompts):
    """One sequence at a time: a high-priority embedding that arrives while low ones wait is served
    next, ahead of every low one still queued."""
    lows = [SeqSpec(f"low{i}", p, 1, priority=10.0, embed=EmbedSpec()) for i, p in enumerate(prompts[:4])]
    high = SeqSpec("high", prompts[4], 1, priority=0.0, embed=EmbedSpec())
    _, _, order = embed_all(_engine(model, max_batch=1), lows, arrivals={1: [high]})
    assert order.index("high") < order.index("low2") and order.index("high") < order.index("low3")
    assert order[0] == "low0" and sorted(order) == sorted(["high"] + [s.uid for s in lows])


def test_a_model_without_hidden_states_refuses_embeddings():
    eng = PagedEngine(_gemma3(), num_blocks=32)
    eng.add([_spec("e", [1, 2, 3])])
    events, _ = eng.step()
    assert [(e.uid, e.finish_reason) for e in events] == [("e", "error")]
    assert "no hidden states to pool" in events[0].error and not eng.has_work()
