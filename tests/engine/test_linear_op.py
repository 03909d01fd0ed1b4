"""The CPU extension's ``linear``: the weight matmuls on the extension's pool (our own loops,
``csrc/rowdot.h``, where the CPU has AVX2 and FMA; else the BLAS's sgemv and sgemm).

Not bit-identical to MLX's matmul (see ``csrc/linear_ops.h``), so every check against MLX is a
float32 error bound (``model_ops.within_float32_rounding``: |got - want| <= 2 K 2^-24 (|x| @ |w|^T
+ |bias|) elementwise), which holds for any weights and any BLAS summation order.
"""

from __future__ import annotations

import ctypes
import os
import random
import subprocess
import sys

import mlx.core as mx
import mlx.nn as nn
import pytest

from mlxq.shared.settings import Settings
from mlxq.worker import blas
from mlxq.worker.engine import PagedEngine
from mlxq.worker.engine.kernels import model_ops
from mlxq.worker.engine.kernels.extbuild import ExtensionUnavailable

from enginekit import extension_with


@pytest.fixture(scope="module")
def ext():
    return extension_with("linear", "no optimized BLAS loaded here: the engine keeps MLX's matmul")


@pytest.mark.parametrize("M", [1, 3, 64, 300])
@pytest.mark.parametrize("N,K", [(5, 7), (37, 41), (16, 512), (300, 64), (1001, 512)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_within_float32_rounding_of_mlx(ext, M, N, K, with_bias):
    rs = mx.random.split(mx.random.key(M * 7919 + N * 31 + K), 3)
    x = mx.random.normal((M, K), key=rs[0]) * 3
    w = mx.random.normal((N, K), key=rs[1])
    bias = mx.random.normal((N,), key=rs[2]) if with_bias else None
    assert model_ops.within_float32_rounding(ext.linear(x, w, bias), x, w, bias)
    # the model's (B, L, K) shape
    x3 = x.reshape(1, M, K)
    assert model_ops.within_float32_rounding(ext.linear(x3, w, bias), x3, w, bias)


def test_linear_reads_any_layout(ext):
    rs = mx.random.split(mx.random.key(3), 4)
    w = mx.random.normal((200, 96), key=rs[0])
    w_cols = mx.random.normal((96, 200), key=rs[1]).T  # a transposed view: columns contiguous
    w_strided = mx.random.normal((200, 192), key=rs[2])[:, ::2]  # neither
    x_rows = mx.random.normal((96, 5), key=rs[3]).T  # strided rows
    x_one = mx.random.normal((96, 3), key=rs[3])[:, 1:2].T  # one strided row (the sgemv path)
    x_bcast = mx.broadcast_to(mx.random.normal((1, 96), key=rs[0]), (4, 96))  # stride 0
    for x in (x_rows, x_one, x_bcast):
        for wm in (w, w_cols, w_strided):
            assert model_ops.within_float32_rounding(ext.linear(x, wm), x, wm)


def test_linear_puts_the_blas_thread_count_back(ext):
    lib = ctypes.CDLL(blas.status().library)
    before = lib.openblas_get_num_threads()
    x, w = mx.random.normal((64, 256)), mx.random.normal((512, 256))
    mx.eval(ext.linear(x, w), ext.linear(x[:1], w))
    assert lib.openblas_get_num_threads() == before


def test_linear_bad_input_is_a_clear_error(ext):
    w = mx.zeros((8, 4))
    with pytest.raises(ValueError, match="float32"):
        ext.linear(mx.zeros((2, 4), dtype=mx.float16), w)
    with pytest.raises(ValueError, match=r"\(N, K\)"):
        ext.linear(mx.zeros((2, 5)), w)
    with pytest.raises(ValueError, match="bias"):
        ext.linear(mx.zeros((2, 4)), w, mx.zeros((3,)))


def test_engine_matmul_setting(ext, tiny_model):
    model = tiny_model.model
    linears = [m for _, m in model.named_modules() if isinstance(m, nn.Linear)]
    eng = PagedEngine(model, num_blocks=16, attention="fused", matmul="pool")
    assert linears and all(type(m) is model_ops.FastLinear and m._mlxq_linear is not None for m in linears)
    assert eng.attention.matmul == "pool"
    eng = PagedEngine(model, num_blocks=16, attention="fused", matmul="mlx")
    assert all(m._mlxq_linear is None for m in linears) and eng.attention.matmul == "mlx"
    eng = PagedEngine(model, num_blocks=16, attention="gather")  # auto, on the reference path: MLX's
    assert all(m._mlxq_linear is None for m in linears) and eng.attention.matmul == "mlx"
    # auto: our own loops where they run, MLX's matmul over the BLAS fallback
    eng = PagedEngine(model, num_blocks=16, attention="fused", matmul="auto")
    assert eng.attention.matmul == ("mlx" if ext.linear_isa() == "blas" else "pool")
    # the default is auto: a row's bits the same in any batch wherever our loops run
    assert Settings().matmul == "auto" and PagedEngine(model, num_blocks=16).attention.matmul == (
        "mlx" if ext.linear_isa() == "blas" else "pool")
    # pool where it cannot run is refused, not quietly MLX's
    with pytest.raises(ExtensionUnavailable, match="matmul=pool needs the CPU extension's linear"):
        PagedEngine(model, num_blocks=16, attention="gather", matmul="pool")
    with pytest.raises(ValueError, match="matmul must be one of auto, pool, mlx"):
        PagedEngine(model, num_blocks=16, matmul="fast")
    with pytest.raises(ValueError, match="matmul"):
        Settings.from_env(matmul="fast")


@pytest.mark.parametrize("M", [1, 3, 64])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_group_is_bit_for_bit_each_linear(ext, M, with_bias):
    """One call for several weights (q/k/v, gate/up) gives each weight's own linear, bit for bit:
    grouping only saves calls. Widths as a layer's (512, 256, 256) and odd ones."""
    K = 96
    rs = mx.random.split(mx.random.key(M * 31 + with_bias), 8)
    x = mx.random.normal((M, K), key=rs[0])
    ws = [mx.random.normal((n, K), key=rs[1 + i]) for i, n in enumerate((512, 256, 256, 37))]
    bs = [mx.random.normal((w.shape[0],), key=rs[5]) for w in ws] if with_bias else []
    outs = ext.linear_group(x, ws, bs)
    for i, (w, out) in enumerate(zip(ws, outs)):
        assert mx.array_equal(out, ext.linear(x, w, bs[i] if bs else None)).item()
    x3 = x.reshape(1, M, K)  # the model's (B, L, K) shape
    assert all(o.shape == (1, M, w.shape[0]) for o, w in zip(ext.linear_group(x3, ws, bs), ws))
    with pytest.raises(ValueError, match="one bias per weight"):
        ext.linear_group(x, ws, bs[:1] if bs else [mx.zeros((512,))])


def test_engine_groups_the_sibling_projections_and_changes_no_bit(ext, tiny_model):
    """With pool matmuls, a layer's q/k/v and its gate/up each run as one call; the model's
    logits are the ungrouped ones bit for bit, and a member given another x computes alone."""
    model = tiny_model.model
    PagedEngine(model, num_blocks=16, attention="fused", matmul="pool")
    layer = model.model.layers[0]
    q, k = layer.self_attn.q_proj, layer.self_attn.k_proj
    assert q._mlxq_group is not None and k._mlxq_group[0] is q._mlxq_group[0]
    assert layer.mlp.gate_proj._mlxq_group is not None
    calls = []
    group = q._mlxq_group[0]
    real = group.op
    group.op = lambda *a: calls.append(1) or real(*a)
    tokens = mx.array([[5, 9, 13, 2, 7]])
    grouped = model(tokens)
    mx.eval(grouped)
    group.op = real
    assert calls == [1]  # the first layer's q/k/v: one call
    model_ops.install_groups(model, None)
    plain = model(tokens)
    assert mx.array_equal(grouped, plain).item()
    model_ops.install_groups(model, ext.linear_group)
    x, other = mx.random.normal((1, 2, q.weight.shape[1])), mx.random.normal((1, 2, q.weight.shape[1]))
    q(x)
    assert mx.array_equal(k(other), ext.linear(other, k.weight, k.bias if "bias" in k else None)).item()
    PagedEngine(model, num_blocks=16, attention="fused", matmul="mlx")
    assert q._mlxq_group is None


def _own_loops(ext) -> None:
    if ext.linear_isa() == "blas":
        pytest.skip("no AVX2+FMA here: linear is the BLAS's sgemm, whose rounding may follow the batch")


def test_a_row_gets_the_same_bits_alone_and_in_any_batch(ext):
    """Our loops sum each output in one order whatever the batch (csrc/rowdot.h): a row computed
    alone equals the same row in batches of every size, a decode step's (from 5 rows on AVX-512
    in pairs of rows through 16-lane registers: 3 or 4 pairs a tile up to 8 rows, 4 pairs by 6
    weight rows past them, an odd row's pair half empty) and a prefill pass's (past the 64-row
    block), with K not a multiple of 8 and with a bias."""
    _own_loops(ext)
    for K, N in ((512, 1184), (1184, 512), (37, 45)):
        rs = mx.random.split(mx.random.key(K), 3)
        x = mx.random.normal((200, K), key=rs[0])
        w, bias = mx.random.normal((N, K), key=rs[1]), mx.random.normal((N,), key=rs[2])
        alone = mx.concatenate([ext.linear(x[i:i + 1], w, bias) for i in range(200)])
        for M in (2, 3, 5, 6, 7, 8, 9, 11, 16, 17, 63, 64, 65, 130, 200):
            batch = ext.linear(x[:M], w, bias)
            assert mx.array_equal(batch, alone[:M]).item(), (K, N, M)
            assert model_ops.within_float32_rounding(batch, x[:M], w, bias)


def test_the_avx2_and_avx512_loops_give_the_same_bits(ext, tmp_path):
    """The AVX-512VL build (32 registers, bigger tiles) sums in the AVX2 build's order: a fresh
    process forced onto AVX2 (MLXQ_ATTN_ISA=avx2) computes the very same outputs, with K a multiple
    of 8 (each tile's sums reduced together, hsum_pairs8 / hsum8) and not (one at a time, then the
    tail). In that process one row alone (its 8 sums reduced at once) equals the same row in 4 x 3
    tiles (hsum one sum at a time)."""
    _own_loops(ext)
    if ext.linear_isa() != "avx512vl":
        pytest.skip("this CPU has no AVX-512VL: only the AVX2 loops run here")
    rs = mx.random.split(mx.random.key(11), 2)
    x, w = mx.random.normal((70, 300), key=rs[0]), mx.random.normal((333, 300), key=rs[1])
    mx.save(str(tmp_path / "x.npy"), x)
    mx.save(str(tmp_path / "w.npy"), w)
    rows = (1, 5, 8, 9, 17, 70)
    script = (
        "from mlxq.worker import blas; blas.setup()\n"
        "import mlx.core as mx\n"
        "from mlxq.worker.engine import attention\n"
        "from mlxq.worker.engine.kernels import model_ops\n"
        "ext = attention.cpu_extension()\n"
        "assert 'linear' in model_ops.checked_ops(ext) and ext.linear_isa() == 'avx2', ext.linear_isa()\n"
        f"x, w = mx.load({str(tmp_path / 'x.npy')!r}), mx.load({str(tmp_path / 'w.npy')!r})\n"
        "for K in (296, 300):\n"
        "    assert mx.array_equal(ext.linear(x[:1, :K], w[:, :K]), ext.linear(x[:5, :K], w[:, :K])[:1]).item(), K\n"
        f"ys = [ext.linear(x[:m, :K], w[:, :K]) for K in (296, 300) for m in {rows}]\n"
        f"mx.save({str(tmp_path / 'y.npy')!r}, mx.concatenate([y.reshape(-1) for y in ys]))\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, MLXQ_ATTN_ISA="avx2"), cwd=str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    here = mx.concatenate([ext.linear(x[:m, :K], w[:, :K]).reshape(-1) for K in (296, 300) for m in rows])
    assert mx.array_equal(mx.load(str(tmp_path / "y.npy")), here).item()


def test_pool_matmuls_keep_batched_greedy_equal_to_solo(ext, tiny_model):
    """With pool matmuls a batched greedy sequence equals the same sequence run alone (the
    engine's guarantee, which MLX's matmul gives on fp32 CPU): staggered joins, ragged prefill
    passes and decode batches of every size give each row the bits it gets alone."""
    _own_loops(ext)
    from mlxq.worker.engine.api import SeqSpec
    from enginekit import drive

    model = tiny_model.model
    rng = random.Random(5)
    specs = [SeqSpec(f"j{i}", [rng.randrange(4, 500) for _ in range(rng.randrange(1, 70))], rng.randrange(5, 40),
                     stop_token_ids=()) for i in range(12)]

    solo = {}
    for s in specs:
        solo.update(drive(PagedEngine(model, num_blocks=64, attention="fused", matmul="pool"), {0: [s]}))
    arrivals: dict[int, list] = {}
    for i, s in enumerate(specs):
        arrivals.setdefault(i // 3, []).append(s)
    batched = drive(PagedEngine(model, num_blocks=64, max_batch=8, attention="fused", matmul="pool"), arrivals)
    assert batched == solo
