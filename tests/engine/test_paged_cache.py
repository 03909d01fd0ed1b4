"""The mlx-lm cache protocol over the block pool, with unmodified model files."""

import sys

import mlx.core as mx
import pytest
from mlx_lm.models import gemma2, gemma3_text, llama, qwen2, qwen3
from mlx_lm.models.cache import make_prompt_cache

from mlxq.worker.engine.block_manager import BlockManager
from mlxq.worker.engine.kv_cache import BatchRow, BatchView, KVPool, make_layer_caches, probe_kv_shape

BS = 32


def _tiny(family: str):
    mx.random.seed(7)
    common = dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                  num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
                  vocab_size=256)
    if family == "llama":
        m = llama.Model(llama.ModelArgs(model_type="llama", tie_word_embeddings=False, **common))
    elif family == "mistral":  # mlx-lm runs mistral checkpoints on llama.py
        m = llama.Model(llama.ModelArgs(model_type="mistral", rope_theta=1e6, **common))
    elif family == "qwen2":
        m = qwen2.Model(qwen2.ModelArgs(model_type="qwen2", **common))
    elif family == "qwen3":
        m = qwen3.Model(qwen3.ModelArgs(model_type="qwen3", max_position_embeddings=4096,
                                        head_dim=16, tie_word_embeddings=True, rope_theta=1e6,
                                        **common))
    elif family == "gemma2":
        # gemma2.py's own GQA attention cannot broadcast any per-row (B>1) mask
        # (stock BatchKVCache fails the same way), so this config has no GQA.
        common["num_key_value_heads"] = 4
        m = gemma2.Model(gemma2.ModelArgs(model_type="gemma2", head_dim=16, **common))
    elif family == "gemma3":  # sliding-window layers (window 16) + a global one
        common["num_hidden_layers"] = 3
        m = gemma3_text.Model(gemma3_text.ModelArgs(
            model_type="gemma3_text", head_dim=16, sliding_window=16,
            sliding_window_pattern=3, query_pre_attn_scalar=16, **common))
    else:
        raise ValueError(family)
    mx.eval(m.parameters())
    return m


FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3"]


def _dense_logits(model, prompt, follow):
    """Last-position logits after the prompt and after each follow-up token."""
    cache = make_prompt_cache(model)
    out = [model(mx.array(prompt)[None], cache=cache)[0, -1]]
    for t in follow:
        out.append(model(mx.array([[t]]), cache=cache)[0, -1])
    mx.eval(out)
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_paged_forward_matches_dense(family):
    model = _tiny(family)
    shape = probe_kv_shape(model)
    bm = BlockManager(48, BS)
    pool = KVPool(shape, 48, BS)
    rng = mx.random.randint(0, 256, (3, 90)).tolist()
    prompts = [rng[0][:5], rng[1][:40], rng[2][:90]]
    follow = [[3, 9, 27, 81], [1, 2, 3, 4], [200, 100, 50, 25]]
    tables, lens, paged = [], [], []
    for p in prompts:
        table = bm.allocate(bm.blocks_needed(len(p) + len(follow[0])))
        pos, chunk = 0, 17  # odd chunk size: chunks straddle block edges
        while pos < len(p):
            n = min(chunk, len(p) - pos)
            view = BatchView([BatchRow(table, pos, n)], BS)
            logits = model(mx.array(p[pos:pos + n])[None], cache=make_layer_caches(pool, view))
            mx.eval(logits, pool.arrays())
            pos += n
        paged.append([logits[0, -1]])
        tables.append(table)
        lens.append(len(p))
    for step in range(len(follow[0])):  # batched decode, rows of unequal length
        view = BatchView([BatchRow(t, n, 1) for t, n in zip(tables, lens)], BS)
        inp = mx.array([[f[step]] for f in follow])
        logits = model(inp, cache=make_layer_caches(pool, view))
        mx.eval(logits, pool.arrays())
        for i in range(3):
            paged[i].append(logits[i, -1])
            lens[i] += 1
    for i, p in enumerate(prompts):
        dense = _dense_logits(model, p, follow[i])
        for a, b in zip(paged[i], dense):
            assert mx.allclose(a, b, atol=1e-4, rtol=1e-4).item(), (family, i)


def test_pool_read_write_blocks_roundtrip():
    model = _tiny("llama")
    pool = KVPool(probe_kv_shape(model), 8, BS)
    data = {k: mx.random.normal(v.shape) for k, v in pool.read_blocks([1, 2]).items()}
    pool.write_blocks([5, 3], data)
    back = pool.read_blocks([5, 3])
    assert all(mx.array_equal(back[k], data[k]).item() for k in data)


def test_bytes_per_block_matches_pool():
    model = _tiny("qwen3")
    shape = probe_kv_shape(model)
    assert KVPool(shape, 10, BS).nbytes == (10 + 1) * shape.bytes_per_block(BS)  # + the scratch block


def test_huge_pages_advice_keeps_the_bytes():
    """hugepages.advise asks the kernel for 2 MiB pages on an array's aligned interior: where the
    kernel allows it, a multiple of 2 MiB within the array; elsewhere 0. Never an error, and the
    array's bytes are what they were."""
    import numpy as np

    from mlxq.worker.engine import hugepages

    a = mx.random.normal((3 << 20,))  # 12 MiB
    mx.eval(a)
    before = np.array(a)
    t = mx.zeros((2048, 2048)).T  # a transposed view: skipped
    h = mx.zeros((3 << 20,), dtype=mx.bfloat16)  # any dtype
    mx.eval(t, h)
    asked = hugepages.advise([a, mx.zeros((16,)), t])
    assert asked % hugepages.HUGE == 0 and asked <= a.nbytes
    assert np.array_equal(np.array(a), before)
    assert hugepages.advise([h]) <= h.nbytes


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="hugepages.pack runs on Linux only")
def test_huge_pages_pack_makes_each_parameter_a_view_of_a_shared_buffer(monkeypatch):
    """hugepages.pack copies the model's smaller parameters into shared buffers, each parameter a
    view of its buffer, starting on a cache line (an address a multiple of 64 bytes, though MLX's own
    buffers start 8 bytes past one): the same values and shapes, the same logits; once."""
    import numpy as np
    from mlx.utils import tree_flatten

    from mlxq.worker.engine import hugepages

    monkeypatch.setattr(hugepages, "_thp_on", lambda: True)  # the copies do not depend on the kernel's THP mode
    monkeypatch.setattr(hugepages, "PACK_BUFFER", 6 << 20)  # several buffers
    mx.random.seed(3)
    m = llama.Model(llama.ModelArgs(model_type="llama", hidden_size=256, num_hidden_layers=4, intermediate_size=512,
                                    num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
                                    vocab_size=1024, tie_word_embeddings=False))
    mx.eval(m.parameters())
    before = {k: np.array(v) for k, v in tree_flatten(m.parameters())}
    x = mx.array([[1, 2, 3, 4, 5]])
    want = m(x)
    mx.eval(want)
    bufs = hugepages.pack(m)
    assert len(bufs) >= 2
    spans = [hugepages._span(b) for b in bufs]
    after = dict(tree_flatten(m.parameters()))
    assert after.keys() == before.keys()
    for k, v in after.items():
        assert v.shape == before[k].shape and v.dtype == mx.float32
        assert np.array_equal(np.array(v), before[k])
        lo, hi = hugepages._span(v)
        home = [s for s in spans if s[0] <= lo and hi <= s[1]]
        assert len(home) == 1 and lo % 64 == 0, k
    assert mx.array_equal(m(x), want).item()
    assert hugepages.pack(m) is bufs


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="hugepages.pack runs on Linux only")
def test_huge_pages_pack_gathers_a_quantized_models_parameters_by_dtype(monkeypatch):
    """A packed model's parameters alternate in dtype (uint32 weights, float16 scales and biases,
    float32 norms): pack gathers each dtype's into buffers of their own, so the weights, a few hundred
    KB each, share buffers large enough for huge pages; the same logits."""
    import mlx.nn as nn
    from mlx.utils import tree_flatten, tree_unflatten

    from mlxq.worker.engine import hugepages

    monkeypatch.setattr(hugepages, "_thp_on", lambda: True)
    monkeypatch.setattr(hugepages, "PACK_BUFFER", 6 << 20)
    mx.random.seed(4)
    m = llama.Model(llama.ModelArgs(model_type="llama", hidden_size=512, num_hidden_layers=4, intermediate_size=1024,
                                    num_attention_heads=8, num_key_value_heads=4, rms_norm_eps=1e-5,
                                    vocab_size=1024, tie_word_embeddings=False))
    nn.quantize(m, group_size=32, bits=8)
    m.update(tree_unflatten([(k, v.astype(mx.float16)) for k, v in tree_flatten(m.parameters())
                             if k.endswith(("scales", "biases"))]))
    mx.eval(m.parameters())
    x = mx.array([[1, 2, 3, 4, 5]])
    want = m(x)
    mx.eval(want)
    spans = [(hugepages._span(b), b.dtype) for b in hugepages.pack(m)]
    weights = [(k, v) for k, v in tree_flatten(m.parameters()) if v.dtype == mx.uint32]
    assert sum(v.nbytes for _, v in weights) > 6 << 20 and all(v.nbytes < 2 << 20 for _, v in weights)
    for k, v in weights:
        lo, hi = hugepages._span(v)
        assert [d for (s, d) in spans if s[0] <= lo and hi <= s[1]] == [mx.uint32], k
    assert mx.array_equal(m(x), want).item()
