"""The CPU extension's ``linear``: the weight matmuls on the extension's pool (sgemv for one row).

Not bit-identical to MLX's matmul (see ``csrc/linear_ops.h``), so every check is against a
float32 error bound (``model_ops.within_float32_rounding``: |got - want| <= 2 K 2^-24 (|x| @ |w|^T
+ |bias|) elementwise), which holds for any weights and any BLAS summation order.
"""

from __future__ import annotations

import ctypes

import mlx.core as mx
import mlx.nn as nn
import pytest

from mlxq.shared.settings import Settings
from mlxq.worker import blas
from mlxq.worker.engine import PagedEngine, attention
from mlxq.worker.engine.kernels import model_ops


@pytest.fixture(scope="module")
def ext():
    ext = attention.cpu_extension()
    if "linear" not in model_ops.checked_ops(ext):
        pytest.skip("no optimized BLAS loaded here: the engine keeps MLX's matmul")
    return ext


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
    PagedEngine(model, num_blocks=16, attention="fused", matmul="pool")
    assert linears and all(type(m) is model_ops.FastLinear and m._mlxq_linear is not None for m in linears)
    PagedEngine(model, num_blocks=16, attention="fused", matmul="mlx")
    assert all(m._mlxq_linear is None for m in linears)
    PagedEngine(model, num_blocks=16, attention="gather")
    assert all(m._mlxq_linear is None for m in linears)
    with pytest.raises(ValueError, match="matmul must be one of pool, mlx"):
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
