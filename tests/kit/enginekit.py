"""Driving an engine in tests the way the worker does (shared by the engine test files).

Only the ``Engine`` protocol's calls (``add``, ``has_work``, the real ``step()``),
as in ``worker/mlx_loop.py``; a preempted sequence comes back as the worker's requeued
job does (``jobs.ActiveJob.spec``): everything it generated becomes its resume
tokens and ``max_tokens`` is what is left.  Redis's part (the requeue) is the list
this loop keeps.

Also the random-weight models, the mlx-lm reference (``dense``), the block-leak check and the
block-manager and session-file probes that the engine test files share.
"""

import os
import random
from dataclasses import replace

SMALL_CHUNKS = ((64, 24), (None, 16))  # tiny chunks so prompts span many steps


def random_llama(seed: int, hidden_size: int = 64, heads: int = 4, kv_heads: int = 2):
    """A 2-layer llama with random weights (vocab 256), evaluated; head dim hidden_size / heads."""
    import mlx.core as mx
    from mlx_lm.models import llama

    mx.random.seed(seed)
    m = llama.Model(llama.ModelArgs(
        model_type="llama", hidden_size=hidden_size, num_hidden_layers=2, intermediate_size=128,
        num_attention_heads=heads, num_key_value_heads=kv_heads, rms_norm_eps=1e-5, vocab_size=256,
        tie_word_embeddings=False))
    mx.eval(m.parameters())
    return m


def run(engine, specs, max_steps=10_000, on_step=None, added=(), prior=None):
    """Drive the engine like the worker: requeue preempted jobs with resume tokens.

    ``added``: specs the test handed to the engine itself before calling this;
    ``prior``: tokens those already emitted (uid -> list).
    Returns each job's full output: resume tokens it came with + emitted ones.
    """
    orig = {s.uid: s for s in list(specs) + list(added)}
    out = {uid: list(s.resume_tokens) + list((prior or {}).get(uid, []))
           for uid, s in orig.items()}
    done = {}
    engine.add(list(specs))
    n_pre = 0
    for i in range(max_steps):
        if not engine.has_work():
            break
        events, preempted = engine.step()
        for e in events:
            assert e.uid not in done, "token after finish"
            out[e.uid].append(e.token)
            if e.finish_reason:
                done[e.uid] = e.finish_reason
        for p in preempted:
            n_pre += 1
            assert p.tokens == out[p.uid], "preempted tokens = everything emitted"
            s = orig[p.uid]
            new = len(p.tokens) - len(s.resume_tokens)
            engine.add([replace(s, resume_tokens=list(p.tokens),
                                max_tokens=s.max_tokens - new)])
        if on_step:
            on_step(i, events)
    assert not engine.has_work()
    return out, done, n_pre


def tiny_llama():
    """A 2-layer llama with random weights (vocab 256, tied embeddings), evaluated."""
    import mlx.core as mx
    from mlx_lm.models import llama

    mx.random.seed(0)
    args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                           num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=256,
                           tie_word_embeddings=True)
    m = llama.Model(args)
    mx.eval(m.parameters())
    return m


def _llama():
    return random_llama(3)


def _gemma3():
    """A 3-layer gemma3 with random weights and a sliding window of 24 on two layers of three."""
    import mlx.core as mx
    from mlx_lm.models import gemma3_text

    mx.random.seed(5)
    m = gemma3_text.Model(gemma3_text.ModelArgs(
        model_type="gemma3_text", hidden_size=64, num_hidden_layers=3, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256,
        sliding_window=24, sliding_window_pattern=3, query_pre_attn_scalar=16))
    mx.eval(m.parameters())
    return m


_dense_memo: dict = {}


def dense(model, prompt, n):
    """Single-sequence greedy mlx-lm reference (memoized per live model)."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    _, memo = _dense_memo.setdefault(id(model), (model, {}))  # keeps the model alive
    key = (tuple(prompt), n)
    if key not in memo:
        memo[key] = [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=n)]
    return memo[key]


def _prompts(seed, n, lo, hi):
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _assert_no_leak(engine):
    st = engine.stats()
    assert st["blocks_used"] == len({b for h in engine.scheduler.hot_sessions.by_id.values() for b in h.block_ids})
    assert st["blocks_used"] + st["blocks_cached"] + st["blocks_free"] == st["blocks_total"]
    engine.bm.check_invariants()


def drive(engine, arrivals, max_steps=2000):
    """Step the engine, adding ``arrivals`` ({step: [SeqSpec]}) at their steps, with no requeue of
    preempted jobs (``run`` does that); returns {uid: [tokens]}."""
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


def chain_hashes(tokens, model_id: str, block_size: int) -> list[bytes]:
    """The chained hashes of every full block of ``tokens`` (what a prefix-cache lookup yields)."""
    from mlxq.worker.engine.block_manager import block_hash

    out: list[bytes] = []
    parent = None
    for i in range(len(tokens) // block_size):
        parent = block_hash(parent, tokens[i * block_size:(i + 1) * block_size], model_id)
        out.append(parent)
    return out


def evict_cached(bm, max_blocks: int) -> int:
    """Forget the hashes of up to ``max_blocks`` unreferenced cached blocks, oldest first, as an
    allocation that reuses them would; how many."""
    n = 0
    for bid in list(bm._lru):
        if n >= max_blocks:
            break
        if bm.blocks[bid].hash is not None:
            bm._forget(bm.blocks[bid])
            n += 1
    return n


def warm_count(session_dir: str) -> int:
    """Session files written (whole: no temporary) in ``session_dir``."""
    return sum(1 for f in os.listdir(session_dir) if f.endswith(".safetensors") and ".tmp." not in f)


def extension_with(op: str, why: str):
    """The CPU extension, or a skip (``why``) where its ``op`` did not pass its check here."""
    import pytest

    from mlxq.worker.engine import attention
    from mlxq.worker.engine.kernels import model_ops

    ext = attention.cpu_extension()
    if op not in model_ops.checked_ops(ext):
        pytest.skip(why)
    return ext
