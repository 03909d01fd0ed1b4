"""The CPU extension's decode-step ops besides attention: swiglu, RoPE, RMSNorm and the in-place KV write.

swiglu, RoPE and RMSNorm must be bit-identical to MLX's (greedy equality with mlx-lm rests on it);
the KV write must equal MLX's scatter and must not copy the pool when it can write
in place.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.activations import swiglu as mlx_swiglu

from mlxq.worker.engine import PagedEngine, attention
from mlxq.worker.engine.kernels import model_ops

from enginekit import run

SPECIAL = [0.0, -0.0, 1e-40, -1e-40, 88.0, -88.0, 88.1, -88.1, 200.0, -200.0, float("inf"),
           float("-inf"), float("nan"), 0.5, -0.5, 0.49999997, -0.49999997, 1e-8, -1e-8, 63.9, -63.9]


@pytest.fixture(scope="module")
def ext():
    return attention.cpu_extension()


@pytest.mark.parametrize("scale", [0.01, 1.0, 4.0, 30.0, 120.0])
def test_swiglu_bit_identical_to_mlx_lm(ext, scale):
    key = mx.random.key(int(scale * 100))
    k1, k2 = mx.random.split(key)
    gate = mx.concatenate([mx.random.normal((3 * 1187,), key=k1) * scale, mx.array(SPECIAL * 2)])
    up = mx.random.normal(gate.shape, key=k2)
    assert mx.array_equal(ext.swiglu(gate, up), mlx_swiglu(gate, up), equal_nan=True).item()
    # the shape the MLP feeds it: (B, L, hidden), an odd tail past the 8-wide loop
    g3, u3 = gate[:3 * 1187].reshape(3, 1, 1187), up[:3 * 1187].reshape(3, 1, 1187)
    assert mx.array_equal(ext.swiglu(g3, u3), mlx_swiglu(g3, u3)).item()
    # large enough to be split over the extension's threads (an MLP's activations at batch 64)
    gl = mx.concatenate([mx.random.normal((64, 1187), key=k1).reshape(-1) * scale, mx.array(SPECIAL)])
    ul = mx.random.normal(gl.shape, key=k2)
    assert mx.array_equal(ext.swiglu(gl, ul), mlx_swiglu(gl, ul), equal_nan=True).item()


def test_swiglu_gradient_matches_mlx_lm(ext):
    g = mx.random.normal((4, 9), key=mx.random.key(1)) * 3
    u = mx.random.normal((4, 9), key=mx.random.key(2))
    w = mx.arange(36, dtype=mx.float32).reshape(4, 9)
    ours = mx.grad(lambda a, b: (ext.swiglu(a, b) * w).sum(), argnums=(0, 1))(g, u)
    theirs = mx.grad(lambda a, b: (mlx_swiglu(a, b) * w).sum(), argnums=(0, 1))(g, u)
    for a, b in zip(ours, theirs):
        assert mx.allclose(a, b, rtol=1e-5, atol=1e-5).item()


def test_swiglu_dispatch_falls_back_where_the_op_does_not_apply(ext, tiny_model):
    assert "mlx_lm.models.llama" in model_ops.install_swiglu(tiny_model.model, ext.swiglu)
    g16 = mx.random.normal((2, 8)).astype(mx.float16)
    assert mx.array_equal(model_ops.swiglu_dispatch(g16, g16), mlx_swiglu(g16, g16)).item()
    g, u = mx.random.normal((2, 8)), mx.random.normal((1, 8))  # broadcasting: mlx-lm's
    assert mx.array_equal(model_ops.swiglu_dispatch(g, u), mlx_swiglu(g, u)).item()
    with pytest.raises(ValueError, match="float32 only"):
        ext.swiglu(g16, g16)
    with pytest.raises(ValueError, match="one shape"):
        ext.swiglu(g, u)


ROPE_CONFIGS = [  # (B, H, T, D, dims, traditional, base, scale)
    (16, 8, 1, 64, 64, False, 10000.0, 1.0), (3, 4, 7, 64, 64, False, 10000.0, 1.0),
    (2, 2, 5, 128, 64, False, 500000.0, 0.25), (4, 8, 3, 64, 64, True, 10000.0, 1.0),
    (1, 2, 33, 80, 80, False, 1e6, 1.0), (5, 3, 2, 96, 32, True, 10000.0, 2.0)]


@pytest.mark.parametrize("B,H,T,D,dims,traditional,base,scale", ROPE_CONFIGS)
def test_rope_bit_identical_to_mlx(ext, B, H, T, D, dims, traditional, base, scale):
    x = mx.random.normal((B, H, T, D), key=mx.random.key(B * 100 + T)) * 3
    # 65533: tokens on both sides of the positions whose cos/sin the op keeps (below 2^16);
    # the last: MLX's sincos hands it to libm
    offsets = [4095, 0, 7, 65533, 100_000, 2**23 + 5]
    offsets = [mx.array(o, dtype=mx.int32) for o in offsets]
    offsets += [mx.arange(B, dtype=mx.int32) * 5, mx.arange(B, dtype=mx.int32) * 17 + 123_456,
                mx.arange(B, dtype=mx.int32) * 9000 + 3]  # rows in and past the kept positions
    for off in offsets:
        want = mx.fast.rope(x, dims, traditional=traditional, base=base, scale=scale, offset=off)
        got = ext.rope(x, dims, traditional, base, scale, off)
        assert mx.array_equal(got, want).item(), off


@pytest.mark.parametrize("B,H,T", [(64, 8, 1), (1, 8, 77), (3, 4, 7)])
def test_rope_reads_views_and_splits_large_calls(ext, B, H, T):
    """The model's queries and keys reach RoPE as (B, H, T, D) views of (B, T, H, D) projections:
    read through their strides; calls of 32k floats and more run on the pool's threads (a batch-64
    decode step, a prefill chunk); a view whose rows are not contiguous is copied first. Every
    one bit for bit MLX's."""
    D = 64
    proj = mx.random.normal((B, T, H, D), key=mx.random.key(B + T)) * 3
    view = proj.transpose(0, 2, 1, 3)
    cols = mx.random.normal((B, H, D, T + 1), key=mx.random.key(7)).swapaxes(2, 3)  # D strided
    for x in (view, mx.array(view), cols):
        for off in (mx.array(9, dtype=mx.int32), mx.arange(B, dtype=mx.int32) * 31 + 70_000):
            want = mx.fast.rope(x, D, traditional=False, base=10000.0, scale=1.0, offset=off)
            assert mx.array_equal(ext.rope(x, D, False, 10000.0, 1.0, off), want).item()


def test_swiglu_large_calls_split_over_the_pool(ext):
    """From 32k floats swiglu runs on the pool's threads in ranges of whole 8-float vectors (a
    batch-64 MLP: 64 x 1184): bit for bit mlx-lm's, an odd tail included."""
    for n in (1 << 15, 64 * 1184, 64 * 1184 + 5):
        k1, k2 = mx.random.split(mx.random.key(n))
        g, u = mx.random.normal((n,), key=k1) * 30, mx.random.normal((n,), key=k2)
        assert mx.array_equal(ext.swiglu(g, u), mlx_swiglu(g, u)).item(), n


def test_row_contiguous_copies_every_layout(ext):
    """Inputs that are not row-contiguous (a transpose, a broadcast, a reversed or stepped slice)
    are copied in runs: the ops see the same values as from a contiguous copy."""
    g = mx.random.normal((6, 5, 40), key=mx.random.key(21))
    views = [g.transpose(1, 0, 2), g[:, ::2], g[::-1], mx.broadcast_to(g[:1], (6, 5, 40)),
             g.transpose(2, 1, 0), g[:, :, ::3]]
    for v in views:
        w = mx.random.normal(v.shape, key=mx.random.key(22))
        assert mx.array_equal(ext.swiglu(v, w), ext.swiglu(mx.array(v) + 0, w)).item()
        assert mx.array_equal(ext.swiglu(v, w), mlx_swiglu(v, w)).item()


def test_fast_rope_module(ext, tiny_model):
    import mlx.nn as nn

    rope = nn.RoPE(64, base=10000)
    x = mx.random.normal((2, 4, 3, 64))
    want = rope(x, offset=5)
    assert model_ops.install_rope(tiny_model.model, ext.rope) >= 1  # the tiny llama's layers
    fast = nn.RoPE(64, base=10000)
    fast.__class__ = model_ops.FastRoPE
    assert mx.array_equal(fast(x, offset=5), want).item()
    offs = mx.array([3, 9], dtype=mx.int32)
    assert mx.array_equal(fast(x, offset=offs), rope(x, offset=offs)).item()
    x16 = x.astype(mx.float16)  # not float32: MLX's own
    assert mx.array_equal(fast(x16, offset=5), rope(x16, offset=5)).item()
    with pytest.raises(ValueError, match="float32 only"):
        ext.rope(x16, 64, False, 10000.0, 1.0, mx.array(0))


def _pools(seed, H=2, S=8 * 32, Dk=16, Dv=8):
    k1, k2 = mx.random.split(mx.random.key(seed))
    return mx.random.normal((H, S, Dk), key=k1), mx.random.normal((H, S, Dv), key=k2)


def _scatter(k_pool, v_pool, keys, values, slots):
    k, v = mx.array(k_pool), mx.array(v_pool)
    B, H, N, _ = keys.shape
    k[:, slots] = keys.transpose(1, 0, 2, 3).reshape(H, B * N, -1)
    v[:, slots] = values.transpose(1, 0, 2, 3).reshape(H, B * N, -1)
    return k, v


@pytest.mark.parametrize("D", [64, 96, 896, 1187])
def test_rms_norm_bit_identical_to_mlx(ext, D):
    k1, k2 = mx.random.split(mx.random.key(D))
    w = mx.random.normal((D,), key=k1)
    x = mx.random.normal((4, 5, D), key=k2) * 20  # 20 rows: groups of 8 side by side, then 4 alone
    for eps in (1e-5, 1e-6):
        assert mx.array_equal(ext.rms_norm(x, w, eps), mx.fast.rms_norm(x, w, eps)).item()
    strided = x.transpose(1, 0, 2)[:, ::2]  # rows read through their strides
    assert mx.array_equal(ext.rms_norm(strided, w, 1e-5), mx.fast.rms_norm(strided, w, 1e-5)).item()
    assert mx.array_equal(ext.rms_norm(mx.zeros((2, D)), w, 1e-5), mx.fast.rms_norm(mx.zeros((2, D)), w, 1e-5)).item()
    for rows in (64, 70, 1000):  # 32k floats and more: on the pool's threads, in groups of 8 rows
        big = mx.random.normal((rows, D), key=mx.random.key(rows)) * 5
        assert mx.array_equal(ext.rms_norm(big, w, 1e-5), mx.fast.rms_norm(big, w, 1e-5)).item()


def test_fast_rms_norm_module(ext, tiny_model):
    """The model's norms become FastRMSNorm (the engine installs them): same output as nn.RMSNorm."""
    import mlx.nn as nn

    norm = nn.RMSNorm(64, eps=1e-5)
    norm.weight = mx.random.normal((64,), key=mx.random.key(3))
    x = mx.random.normal((2, 5, 64), key=mx.random.key(4))
    want = norm(x)
    model_ops.install_rms_norm(norm, ext.rms_norm)
    assert type(norm) is model_ops.FastRMSNorm and mx.array_equal(norm(x), want).item()
    assert mx.array_equal(norm(x.astype(mx.float16)), mx.fast.rms_norm(x.astype(mx.float16), norm.weight, 1e-5)).item()


def test_ops_read_strided_inputs(ext):
    """No Contiguous node sits in front of the ops: a strided input is copied inside the op."""
    k1, k2 = mx.random.split(mx.random.key(21))
    gate, up = mx.random.normal((40, 6), key=k1).T, mx.random.normal((6, 40), key=k2)
    assert mx.array_equal(ext.swiglu(gate, up), mlx_swiglu(gate, up)).item()
    x = mx.random.normal((2, 5, 3, 64), key=k1).transpose(0, 2, 1, 3)
    off = mx.array([3, 9], dtype=mx.int32)[::-1]
    want = mx.fast.rope(x, 64, traditional=False, base=10000.0, scale=1.0, offset=mx.array([9, 3]))
    assert mx.array_equal(ext.rope(x, 64, False, 10000.0, 1.0, off), want).item()
    rs = mx.random.split(mx.random.key(22), 3)
    k_pool, v_pool = mx.random.normal((2, 8 * 32, 64), key=rs[0]), mx.random.normal((2, 8 * 32, 64), key=rs[1])
    q = mx.random.normal((2, 3, 4, 64), key=rs[2]).transpose(0, 2, 1, 3)
    tables = mx.array([[3, 1, 6], [0, 5, 2]], dtype=mx.int32)[:, ::-1]
    args = (q, k_pool, v_pool, tables, mx.array([70, 5], dtype=mx.int32), mx.array([73, 8], dtype=mx.int32), 0.125)
    assert mx.max(mx.abs(ext.paged_attention(*args, 40) - attention.gather_attention(*args, 40))).item() < 1e-5


def test_kv_write_equals_scatter_and_keeps_a_referenced_input(ext):
    k_pool, v_pool = _pools(0)
    mx.eval(k_pool, v_pool)
    before = mx.array(k_pool)
    keys = mx.random.normal((3, 4, 2, 16)).transpose(0, 2, 1, 3)  # (B, H, N, D), not contiguous
    values = mx.random.normal((3, 2, 4, 8))
    slots = mx.array([5, 6, 7, 8, 40, 41, 42, 43, 255, 0, 100, 101], dtype=mx.int32)
    want_k, want_v = _scatter(k_pool, v_pool, keys, values, slots)
    got_k, got_v = ext.paged_kv_write(k_pool, v_pool, keys, values, slots)
    assert mx.array_equal(got_k, want_k).item() and mx.array_equal(got_v, want_v).item()
    # k_pool was still referenced here, so the op copied it: the input is unchanged
    assert mx.array_equal(k_pool, before).item()


def test_kv_write_is_in_place_when_the_pool_is_donated(ext):
    H, S, D = 4, 64 * 1024, 64  # 64 MiB per pool
    pools = [mx.zeros((H, S, D)), mx.zeros((H, S, D))]
    mx.eval(pools)
    rows = mx.ones((8, H, 1, D))
    slots = mx.arange(8, dtype=mx.int32) * 1000
    mx.eval(rows, slots)
    pool_bytes = pools[0].nbytes
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    for _ in range(3):
        pools[0], pools[1] = ext.paged_kv_write(pools[0], pools[1], rows, rows, slots)
        mx.eval(pools)
    assert mx.get_peak_memory() - base < pool_bytes // 2  # no pool-sized copy was made
    assert pools[0][:, slots].sum().item() == 8 * H * D


def _busy_stream(seconds: float) -> mx.array:
    """A scalar zero whose computation keeps the CPU stream busy for about ``seconds``
    (a matmul chain sized by timing one matmul here): work queued behind it is still
    pending when the test encodes the next op, by construction."""
    import time

    m = mx.random.normal((512, 512), key=mx.random.key(3)) / 512 ** 0.5
    mx.eval(m)
    t0 = time.perf_counter()
    mx.eval(m @ m)
    n = max(4, int(seconds / max(time.perf_counter() - t0, 1e-4)))
    x = m
    for _ in range(n):
        x = x @ m
    return 0 * mx.sum(x)


def test_kv_write_waits_for_queued_attention_reads_then_writes_in_place(ext):
    """The next step's KV write, encoded while this step's attention is still queued on
    the stream (mx.async_eval pipelining), writes the pool in place once that read ran:
    no copy, and the queued read still sees the pool as it was."""
    H, Dk, Dv, bs = 2, 16, 8, 32
    k_pool, v_pool = _pools(4, H=H, S=4 * bs, Dk=Dk, Dv=Dv)
    q = mx.random.normal((1, 2 * H, 1, Dk), key=mx.random.key(5))
    new_k, new_v = mx.ones((1, H, 1, Dk)), mx.ones((1, H, 1, Dv))
    tables, q_off, lens = mx.array([[0, 1]]), mx.array([39]), mx.array([40])
    mx.eval(k_pool, v_pool, q, new_k, new_v)
    want_read = ext.paged_attention(q, k_pool, v_pool, tables, q_off, lens, 0.25)
    want_k, want_v = _scatter(k_pool, v_pool, new_k, new_v, mx.array([39], dtype=mx.int32))
    mx.eval(want_read, want_k, want_v)
    copies, waits = ext.kv_write_copies(), ext.kv_write_waits()

    read = ext.paged_attention(q + _busy_stream(2.0), k_pool, v_pool, tables, q_off, lens, 0.25)
    mx.async_eval(read)  # queued behind ~2 s of matmuls
    k_pool, v_pool = ext.paged_kv_write(k_pool, v_pool, new_k, new_v, mx.array([39], dtype=mx.int32))
    mx.async_eval(k_pool, v_pool)  # the old pools' only other holder is the queued read
    mx.eval(read, k_pool, v_pool)
    assert ext.kv_write_copies() == copies
    assert ext.kv_write_waits() > waits
    assert mx.array_equal(read, want_read).item()  # the read ran before the write
    assert mx.array_equal(k_pool, want_k).item() and mx.array_equal(v_pool, want_v).item()


def test_kv_write_behind_a_queued_read_still_copies_a_pool_held_elsewhere(ext):
    """Queued reads are waited for, but a pool the caller still holds is never written in place."""
    k_pool, v_pool = _pools(6)
    mx.eval(k_pool, v_pool)
    q = mx.random.normal((1, 4, 1, 16), key=mx.random.key(7))
    before = mx.array(k_pool)
    mx.eval(before)
    read = ext.paged_attention(q + _busy_stream(0.5), k_pool, v_pool, mx.array([[0]]), mx.array([3]),
                               mx.array([4]), 0.25)
    mx.async_eval(read)
    copies = ext.kv_write_copies()
    k2, v2 = ext.paged_kv_write(k_pool, v_pool, mx.ones((1, 2, 1, 16)), mx.ones((1, 2, 1, 8)),
                                mx.array([3], dtype=mx.int32))
    mx.eval(k2, v2, read)
    assert ext.kv_write_copies() == copies + 2
    assert mx.array_equal(k_pool, before).item()
    assert k2[:, 3].sum().item() == 2 * 16


def test_kv_write_bad_input_is_a_clear_error(ext):
    k_pool, v_pool = _pools(1)
    keys = mx.zeros((1, 2, 1, 16))
    values = mx.zeros((1, 2, 1, 8))
    with pytest.raises(ValueError, match="slots must be"):
        ext.paged_kv_write(k_pool, v_pool, keys, values, mx.array([1, 2], dtype=mx.int32))
    with pytest.raises(ValueError, match="dtype"):
        ext.paged_kv_write(k_pool, v_pool, keys.astype(mx.float16), values, mx.array([1], dtype=mx.int32))
    with pytest.raises(ValueError, match="heads"):
        ext.paged_kv_write(k_pool, v_pool, mx.zeros((1, 3, 1, 16)), values, mx.array([1], dtype=mx.int32))


def test_engine_uses_the_ops_only_with_the_fused_backend(ext, tiny_model):
    model = tiny_model.model
    fused = PagedEngine(model, num_blocks=16, attention="fused")
    assert fused.pool.kv_write is not None
    # linear and quantized_linear too, over the optimized BLAS (tests/engine/test_linear_op.py, test_quantized_linear.py)
    assert fused.attention.model_ops[:3] == ("swiglu", "rope", "rms_norm"), fused.attention.reason
    assert set(fused.attention.model_ops[3:]) <= {"linear", "quantized_linear"}
    gather = PagedEngine(model, num_blocks=16, attention="gather")
    assert gather.pool.kv_write is None


@pytest.mark.parametrize("matmul", ["mlx", "pool"])
def test_engine_writes_the_pool_in_place_through_joins_and_preemption(ext, tiny_model, matmul):
    """No KV write copies its pool during a run with joins, chunked prefill and preemption
    (a copy would mean a pool-sized copy per layer: a pass whose attention is still queued
    is waited for: writable_in_place in csrc/cpu_ops.cpp); the tokens equal the reference (gather) path's."""
    from mlxq.worker.engine.api import SeqSpec

    def spec(uid, n, prio):
        return SeqSpec(uid, [(7 * i + n) % 500 + 4 for i in range(n)], 40, stop_token_ids=(), priority=prio)

    results = []
    for mode in ("fused", "gather"):
        # speculation off: the test needs the preemption a one-token-a-step schedule gives
        eng = PagedEngine(tiny_model.model, num_blocks=12, attention=mode, priority_gap=1.0,
                          matmul=matmul if mode == "fused" else "mlx", speculate="off")
        before = ext.kv_write_copies()
        later = {2: [spec("c", 140, 5)], 5: [spec("urgent", 60, 0)]}  # join after steps 3 and 6

        def join(i, _events):
            if i in later:
                eng.add(later[i])

        out, done, n_pre = run(eng, [spec("a", 30, 5), spec("b", 90, 5)], on_step=join,
                               added=[s for specs in later.values() for s in specs])
        if mode == "fused":
            assert ext.kv_write_copies() == before
            assert n_pre >= 1  # the small pool made the urgent job preempt
        assert all(len(toks) == 40 for toks in out.values()) and len(done) == 4
        results.append(out)
    if matmul == "mlx":  # the pool's matmuls round differently from MLX's (tests/engine/test_linear_op.py)
        assert results[0] == results[1]


def test_the_wheel_ships_every_kernel_source_and_engine_package():
    """pyproject names every engine package and every file the extension build reads."""
    import fnmatch
    from mlxq.worker.engine.kernels import extbuild

    tomllib = pytest.importorskip("tomllib")
    from repokit import ROOT as root
    setup = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    engine_pkgs = {"mlxq.worker." + str(p.parent.relative_to(root / "worker")).replace("/", ".")
                   for p in (root / "worker" / "engine").rglob("__init__.py")}
    assert engine_pkgs and engine_pkgs <= set(setup["packages"])
    patterns = setup["package-data"]["mlxq.worker.engine.kernels"]
    kernels = extbuild.SOURCE_DIR.parent
    for f in extbuild.SOURCE_DIR.iterdir():
        rel = str(f.relative_to(kernels))
        assert any(fnmatch.fnmatch(rel, p) for p in patterns), rel


# ---------------------------------------------------------------- categorical sampling
def _draw_ok(logits, inv_temp, u, tok, eps=2e-5):
    """tok is the inverse CDF of softmax(logits * inv_temp) at u (float64 reference), up to eps."""
    x = np.asarray(logits, dtype=np.float64) * inv_temp
    p = np.exp(x - x.max())
    p /= p.sum()
    cdf = np.cumsum(p)
    lo = cdf[tok - 1] if tok > 0 else 0.0
    return p[tok] > 0 and lo - eps <= u <= cdf[tok] + eps


@pytest.mark.parametrize("V", [13, 8192, 50257])
def test_categorical_is_the_inverse_cdf_of_each_row(ext, V):
    rng = np.random.default_rng(V)
    B = 16
    logits = (rng.standard_normal((B, V)) * 4).astype(np.float32)
    logits[:, ::7] = -np.inf  # masked entries
    inv_temp = rng.uniform(0.3, 3.0, size=B).astype(np.float32)
    u = rng.random(B).astype(np.float32)
    u[0], u[1] = 0.0, np.float32(1 - 2 ** -24)
    args = (mx.array(logits), mx.array(inv_temp), mx.array(u))
    got = np.array(ext.categorical(*args))
    fallback = np.array(_mlx_fallback(*args))
    for b in range(B):
        assert logits[b, got[b]] > -np.inf
        assert _draw_ok(logits[b], inv_temp[b], u[b], int(got[b])), (b, got[b])
        assert _draw_ok(logits[b], inv_temp[b], u[b], int(fallback[b])), (b, fallback[b])
        alone = ext.categorical(args[0][b:b + 1], args[1][b:b + 1], args[2][b:b + 1]).item()
        assert alone == got[b]  # a row's draw does not depend on its batch


def _mlx_fallback(logits, inv_temp, u):
    """The sampler's MLX-ops path (what runs where the extension is not loaded)."""
    from mlxq.worker.engine import sampler

    saved = sampler._ext
    sampler._ext = False
    try:
        return sampler.categorical(logits, inv_temp, u)
    finally:
        sampler._ext = saved


def test_categorical_frequencies_and_edges(ext):
    rng = np.random.default_rng(3)
    logits = (rng.standard_normal(11) * 2).astype(np.float32)
    logits[4] = -np.inf
    n = 100_000
    u = rng.random(n).astype(np.float32)
    toks = np.array(ext.categorical(mx.array(np.tile(logits, (n, 1))), mx.full((n,), 0.7), mx.array(u)))
    p = np.exp((logits - logits.max()) * 0.7)
    p /= p.sum()
    freq = np.bincount(toks, minlength=11) / n
    assert freq[4] == 0
    assert np.abs(freq - p).max() < 0.01
    masked = mx.full((2, 9), -np.inf)
    assert ext.categorical(masked, mx.ones((2,)), mx.array([0.0, 0.5])).tolist() == [0, 0]
    one = mx.array([[-np.inf, -np.inf, 3.0, -np.inf]])
    for uu in (0.0, 0.5, 1 - 2 ** -24):
        assert ext.categorical(one, mx.ones((1,)), mx.array([uu])).item() == 2
    with pytest.raises(ValueError, match="categorical"):
        ext.categorical(mx.zeros((2, 3)), mx.ones((3,)), mx.zeros((2,)))


def test_seeded_sampling_does_not_depend_on_the_batch(ext):
    """sample_rows on a row alone and among others: the same draw (its own uniform stream)."""
    from mlxq.shared.schemas import SamplingParams
    from mlxq.worker.engine.sampler import RowSampler, sample_rows

    rng = np.random.default_rng(5)
    lp = mx.array((rng.standard_normal((6, 300)) * 3).astype(np.float32))
    for params in (SamplingParams(temperature=0.8), SamplingParams(temperature=1.0, top_p=0.9),
                   SamplingParams(temperature=0.5, top_k=20)):
        lps = lp - mx.logsumexp(lp, axis=-1, keepdims=True)
        batch = [RowSampler(params, 42, 3, sample=i) for i in range(6)]
        together = sample_rows(lps, batch).tolist()
        alone = [sample_rows(lps[i:i + 1], [RowSampler(params, 42, 3, sample=i)]).item() for i in range(6)]
        assert together == alone


def test_argmax_equals_mlx(ext):
    """The greedy op: mx.argmax's answer (the first of equal maxima) on ties, -inf, NaN-free rows of
    any length (tails shorter than a vector), strided input."""
    rng = np.random.default_rng(9)
    for V in (1, 5, 8, 13, 64, 8192, 50257):
        x = rng.standard_normal((7, V)).astype(np.float32)
        x[1] = np.round(x[1])  # many ties
        x[2, :] = -np.inf
        x[3, : V // 2] = -np.inf
        x[4] = 0.0  # all equal
        x[5, -1] = 100.0  # the max in the tail
        x[6, min(3, V - 1)] = x[6, V - 1] = 50.0  # equal maxima, the first one wins
        a = mx.array(x)
        assert ext.argmax(a).tolist() == mx.argmax(a, axis=-1).tolist(), V
    wide = mx.array(rng.standard_normal((6, 300)).astype(np.float32))
    assert ext.argmax(wide[::2, 10:]).tolist() == mx.argmax(wide[::2, 10:], axis=-1).tolist()
    with pytest.raises(ValueError, match="argmax"):
        ext.argmax(mx.zeros((2, 3, 4)))


def test_a_top_k_at_or_over_the_vocabulary_keeps_every_token():
    """top_k of the vocabulary's size or more (a common way to say "off") filters nothing; mlx-lm's
    apply_top_k raises there, which took the whole engine step down."""
    from mlxq.shared.schemas import SamplingParams
    from mlxq.worker.engine.sampler import RowSampler, sample_rows

    lps = mx.log(mx.softmax(mx.random.normal((1, 64), key=mx.random.key(3)), axis=-1))
    draws = {}
    for k in (64, 65, 1_000_000):
        params = SamplingParams(temperature=1.0, top_k=k)
        draws[k] = [sample_rows(lps, [RowSampler(params, 7, step)]).item() for step in range(20)]
    assert draws[64] == draws[65] == draws[1_000_000]
    assert len(set(draws[64])) > 1  # really sampled, not collapsed to one token
