"""Driving an engine in tests the way the worker does (shared by the engine test files).

Only the ``Engine`` protocol's calls (``add``, ``has_work``, the real ``step()``),
as in ``worker/runner.py``; a preempted sequence comes back as the worker's requeued
job does (``jobs.ActiveJob.spec``): everything it generated becomes its resume
tokens and ``max_tokens`` is what is left.  Redis's part (the requeue) is the list
this loop keeps.
"""

from dataclasses import replace


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
