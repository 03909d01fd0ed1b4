"""The CPU extension's ``quantized_linear``: 4- and 8-bit weights (MLX's affine blocks, as a GGUF's
Q4_0/Q4_1/Q8_0 load) read as stored (``csrc/qmatmul.h``), and the worker setting that chooses it
(``cpu_weights=quantized``); its integer dot products on x rounded to 8 bits (``csrc/qdot.h``,
``cpu_weights=int8-dot``).

Where ``linear`` runs its own loops (AVX2+FMA) the op is bit for bit ``linear`` on the weights MLX's
dequantize gives, so the quantized model computes what its fp32 copy does; int8_dot is within x's
rounding of it; anywhere, a row gets the same bits alone and in any batch."""

from __future__ import annotations

import os
import subprocess
import sys

import mlx.core as mx
import mlx.nn as nn
import pytest

from mlxq.shared.settings import Settings
from mlxq.worker.engine import PagedEngine
from mlxq.worker.engine.api import SeqSpec
from mlxq.worker.engine.kernels import model_ops
from mlxq.worker.model import INT8_DOT_ATTR, load_model, narrow_scales, to_fp32, to_fp32_packed

from enginekit import SMALL_CHUNKS, extension_with, run


@pytest.fixture(scope="module")
def ext():
    return extension_with("quantized_linear", "quantized_linear did not pass its check here")


def _quantized(N, K, bits, group, seed):
    rs = mx.random.split(mx.random.key(seed), 2)
    wq, scales, biases = mx.quantize(mx.random.normal((N, K), key=rs[0]), group_size=group, bits=bits)
    scales, biases = scales.astype(mx.float32), biases.astype(mx.float32)
    return wq, scales, biases, mx.dequantize(wq, scales, biases, group_size=group, bits=bits)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_a_row_gets_linears_bits_on_the_dequantized_weights_alone_and_in_any_batch(ext, bits, group):
    """One row (dequantized in registers, 4 weight rows at a time) and several (a strip of weight rows
    dequantized into a buffer, then linear's own tiles: pairs of rows, past 64 rows blocks), a ragged
    column split: each row the bits it gets alone, and those of linear() on dequantize(w)."""
    K, N = 384, 333
    wq, scales, biases, w = _quantized(N, K, bits, group, bits * 1000 + group)
    x = mx.random.normal((70, K), key=mx.random.key(group)) * 3
    alone = mx.concatenate([ext.quantized_linear(x[i:i + 1], wq, scales, biases, group, bits) for i in range(70)])
    assert model_ops.within_float32_rounding(alone, x, w)
    if ext.linear_isa() != "blas":
        assert mx.array_equal(alone, ext.linear(x, w, None)).item()
    for M in (2, 3, 5, 9, 17, 70):
        assert mx.array_equal(ext.quantized_linear(x[:M], wq, scales, biases, group, bits), alone[:M]).item(), M
    x3 = x[:4].reshape(2, 2, K)  # the model's (B, L, K)
    assert mx.array_equal(ext.quantized_linear(x3, wq, scales, biases, group, bits).reshape(4, N), alone[:4]).item()


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 128])
def test_int8_dot_is_within_xs_rounding_and_a_row_gets_its_bits_in_any_batch(ext, bits, group):
    """x rounded to 8 bits per block of 32, integer dot products: within that rounding's bound of
    x @ dequantize(w).T, and (rows in pairs against 4 weight rows, a ragged column split, calls small
    enough to run on one thread and large enough to split) each row the bits it gets alone."""
    K, N = 384, 333
    wq, scales, biases, w = _quantized(N, K, bits, group, bits * 100 + group)
    x = mx.random.normal((70, K), key=mx.random.key(group + 1)) * 3
    x = x.at[3, :32].add(40.0)  # one block with a large value: a coarse step for that block only
    alone = mx.concatenate([ext.quantized_linear(x[i:i + 1], wq, scales, biases, group, bits, int8_dot=True)
                            for i in range(70)])
    assert model_ops.within_int8_rounding(alone, x, w)
    assert not mx.array_equal(alone, ext.quantized_linear(x, wq, scales, biases, group, bits)).item()
    for M in (2, 3, 9, 70):
        got = ext.quantized_linear(x[:M], wq, scales, biases, group, bits, int8_dot=True)
        assert mx.array_equal(got, alone[:M]).item(), M
    outs = ext.quantized_linear_group(x[:5], [wq, wq[:40]], [scales, scales[:40]], [biases, biases[:40]], group, bits,
                                      True)
    assert mx.array_equal(outs[0], alone[:5]).item() and mx.array_equal(outs[1], alone[:5, :40]).item()


def _as(dtype, scales, biases):
    """scales and biases rounded to ``dtype``'s values (a few of the scales fp16 subnormals), as float32
    and as ``dtype``: the same numbers in two types."""
    scales = scales.at[:, 0].multiply(2.0 ** -12)
    narrow = scales.astype(dtype), biases.astype(dtype)
    return tuple(a.astype(mx.float32) for a in narrow), narrow


@pytest.mark.parametrize("bits", [4, 8])
def test_int8_dot_reads_16_bit_scales_as_the_float32s_they_hold(ext, bits):
    """int8_dot takes fp16 and bf16 scales and biases (cpu_weights=int8-dot keeps them so where exact):
    the very bits it gives on the same values in float32, one row and several, a chunk of fewer than 8
    blocks (K = 12 blocks) and groups of 4 blocks, alone, in a group and in the fused layer ops."""
    wq, s32, b32, _ = _quantized(40, 384, bits, 32, bits + 7)
    wg, sg32, bg32, _ = _quantized(48, 384, bits, 128, bits + 8)
    x = mx.random.normal((5, 384), key=mx.random.key(bits)) * 3
    for dtype in (mx.float16, mx.bfloat16):
        (s, b), (sn, bn) = _as(dtype, s32, b32)
        (sg, bg), (sgn, bgn) = _as(dtype, sg32, bg32)
        for M in (1, 5):
            want = ext.quantized_linear(x[:M], wq, s, b, 32, bits, int8_dot=True)
            assert mx.array_equal(ext.quantized_linear(x[:M], wq, sn, bn, 32, bits, int8_dot=True), want).item()
            want = ext.quantized_linear(x[:M], wg, sg, bg, 128, bits, int8_dot=True)
            assert mx.array_equal(ext.quantized_linear(x[:M], wg, sgn, bgn, 128, bits, int8_dot=True), want).item()
        outs = ext.quantized_linear_group(x, [wq, wq[:8]], [sn, sn[:8]], [bn, bn[:8]], 32, bits, True)
        assert all(mx.array_equal(o, ext.quantized_linear(x, wq[:n], s[:n], b[:n], 32, bits, int8_dot=True)).item()
                   for o, n in zip(outs, (40, 8)))
    # the fused layer ops (D = 64: q, k and v of 2 heads of 32, an MLP 64 wide), one weight throughout
    h, ln, at = mx.random.normal((2, 1, 64), key=mx.random.key(3)), mx.ones((64,)), mx.array([0, 7])
    w, s, b, _ = _quantized(64, 64, bits, 32, bits + 9)
    (s, b), (sn, bn) = _as(mx.float16, s, b)
    kw = dict(group_size=32, bits=bits, int8_dot=True)
    attn = (h, ln, 1e-5, [w] * 3, [], 2, 2, 32, False, 1e4, 1.0, at)
    for got, want in zip(ext.attn_in(*attn, qscales=[sn] * 3, qbiases=[bn] * 3, **kw),
                         ext.attn_in(*attn, qscales=[s] * 3, qbiases=[b] * 3, **kw)):
        assert mx.array_equal(got, want).item()
    mlp = (h, h, w, ln, 1e-5, w, w, w, [None] * 4)
    assert mx.array_equal(ext.mlp_block(*mlp, qscales=[sn] * 4, qbiases=[bn] * 4, **kw),
                          ext.mlp_block(*mlp, qscales=[s] * 4, qbiases=[b] * 4, **kw)).item()


def test_int8_dot_keeps_scales_in_the_narrowest_exact_type():
    """narrow_scales (cpu_weights=int8-dot, at load): float16 where scales and biases are fp16 values,
    else bfloat16 where they are bf16 values (bf16 ones times 2^-30 are not fp16s), else float32 as they
    are; MLX's own ops (where the extension's does not run, and the embedding's lookup) get them widened:
    the same outputs as on the float32s."""
    def layer(cls, scales, biases):
        m = cls(8, 64, group_size=32, bits=4) if cls is model_ops.FastQuantizedEmbedding else cls(64, 8, False, 32, 4)
        m.update({"weight": wq, "scales": scales, "biases": biases})
        object.__setattr__(m, INT8_DOT_ATTR, True)
        return m

    wq, s, b, _ = _quantized(8, 64, 4, 32, 3)
    (s16, b16), _ = _as(mx.float16, s, b)
    (sb, bb), _ = _as(mx.bfloat16, s, b)
    cases = {"float16": (s16, b16), "bfloat16": (sb * 2.0 ** -30, bb), "float32": (s16, b)}
    x, ids = mx.random.normal((2, 64), key=mx.random.key(4)), mx.array([[3, 0, 7]])
    for want, (scales, biases) in cases.items():
        linear = layer(model_ops.FastQuantizedLinear, scales, biases)
        embedding = layer(model_ops.FastQuantizedEmbedding, scales, biases)
        before = linear(x), embedding(ids), embedding.as_linear(x)
        assert narrow_scales(linear) == want and linear["scales"].dtype == linear["biases"].dtype == getattr(mx, want)
        assert narrow_scales(embedding) == want
        assert all(mx.array_equal(a, z).item() and a.dtype == mx.float32
                   for a, z in zip((linear(x), embedding(ids), embedding.as_linear(x)), before))


def test_a_group_is_bit_for_bit_each_call(ext):
    """q/k/v (or gate/up) as one call: each output its own quantized_linear's, at one row and several."""
    parts = [_quantized(n, 128, 4, 32, n) for n in (96, 32, 40)]
    for M in (1, 5):
        x = mx.random.normal((M, 128), key=mx.random.key(M))
        outs = ext.quantized_linear_group(x, *([p[i] for p in parts] for i in range(3)), 32, 4)
        for (wq, scales, biases, _), out in zip(parts, outs):
            assert mx.array_equal(out, ext.quantized_linear(x, wq, scales, biases, 32, 4)).item()
    with pytest.raises(ValueError, match="each with its scales and biases"):
        ext.quantized_linear_group(x, [parts[0][0]], [], [], 32, 4)


def test_bad_input_is_a_clear_error(ext):
    wq, scales, biases, _ = _quantized(16, 64, 4, 32, 1)
    x = mx.zeros((2, 64))
    with pytest.raises(ValueError, match="bits must be 4 or 8"):
        ext.quantized_linear(x, wq, scales, biases, 32, 3)
    with pytest.raises(ValueError, match="group_size must be"):
        ext.quantized_linear(x, wq, scales, biases, 16, 4)
    with pytest.raises(ValueError, match="x must be float32"):
        ext.quantized_linear(x.astype(mx.float16), wq, scales, biases, 32, 4)
    with pytest.raises(ValueError, match=r"packed weight must be uint32 \(N, K \* bits / 32\)"):
        ext.quantized_linear(mx.zeros((2, 128)), wq, scales, biases, 32, 4)
    with pytest.raises(ValueError, match=r"scales and biases must be float32 \(float16 and bfloat16 are for int8_dot"):
        ext.quantized_linear(x, wq, scales.astype(mx.float16), biases.astype(mx.float16), 32, 4)
    with pytest.raises(ValueError, match="scales and biases must be both float32, both float16 or both bfloat16"):
        ext.quantized_linear(x, wq, scales.astype(mx.float16), biases, 32, 4, int8_dot=True)
    # the fused layer ops take packed weights only whole, and without biases
    h, ln = mx.zeros((1, 1, 64)), mx.ones((64,))
    with pytest.raises(ValueError, match="attn_in: packed weights need a scales and a biases array each"):
        ext.attn_in(h, ln, 1e-5, [wq, wq, wq], [], 4, 2, 16, False, 1e4, 1.0, mx.array([0]), qscales=[scales],
                    qbiases=[biases], group_size=32, bits=4)
    w64, s64, b64, _ = _quantized(64, 64, 4, 32, 2)
    with pytest.raises(ValueError, match="mlp_block: packed weights take no biases"):
        ext.mlp_block(h, h, w64, ln, 1e-5, w64, w64, w64, [mx.zeros((64,)), None, None, None], qscales=[s64] * 4,
                      qbiases=[b64] * 4, group_size=32, bits=4)


def _tiny_4_bit(model_dir, cpu_weights: str):
    """The tiny model with its Linear and Embedding layers quantized to 4 bits in groups of 32 (as a
    4-bit checkpoint loads), then as the worker's cpu_weights setting leaves it."""
    loaded = load_model(str(model_dir), name="tiny-q4", cpu_weights=cpu_weights)
    nn.quantize(loaded.model, group_size=32, bits=4)
    if cpu_weights == "fp32":
        return loaded.model, to_fp32(loaded.model)
    return loaded.model, to_fp32_packed(loaded.model, int8_dot=cpu_weights == "int8-dot")


def test_the_engine_on_4_bit_weights_computes_what_it_does_on_their_fp32_values(ext, tiny_model_dir):
    model, note = _tiny_4_bit(tiny_model_dir, "quantized")
    assert note == "quantized layers kept packed (4-bit x 15)"
    eng = PagedEngine(model, num_blocks=64, matmul="pool", chunk_schedule=SMALL_CHUNKS)
    assert "on packed weights" in eng.decode_path, eng.decode_path  # the fused ops on the packed blocks
    layers = [m for _, m in model.named_modules() if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))]
    assert all(type(m) in (model_ops.FastQuantizedLinear, model_ops.FastQuantizedEmbedding)
               and m._mlxq_qlinear is not None for m in layers)
    prompts = [[1, 17, 250, 9, 400, 33, 700, 5, 64, 128, 900, 12, 3, 511] * 3, [5, 9, 13], [700, 2]]
    specs = [SeqSpec(f"s{i}", p, 12, stop_token_ids=()) for i, p in enumerate(prompts)]
    together, _, _ = run(eng, specs)
    # greedy: each sequence alone equals the three together (prefilled in chunks, decoded as a batch)
    for s in specs:
        alone, _, _ = run(eng, [s])
        assert alone[s.uid] == together[s.uid], s.uid
    # the same blocks dequantized to float32 at load (cpu_weights=fp32): the same logits, bit for bit
    # where linear runs its own loops, and the same tokens
    dense, note = _tiny_4_bit(tiny_model_dir, "fp32")
    assert note == "dequantized"
    eng_f = PagedEngine(dense, num_blocks=64, matmul="pool", chunk_schedule=SMALL_CHUNKS)
    ids = mx.array([prompts[0]])
    if ext.linear_isa() != "blas":
        assert mx.array_equal(model(ids), dense(ids)).item()
    else:
        assert mx.allclose(model(ids), dense(ids), rtol=1e-4, atol=1e-4).item()
    assert run(eng_f, specs)[0] == together
    PagedEngine(model, num_blocks=16, matmul="mlx")  # the matmul setting takes it away with linear's
    assert all(m._mlxq_qlinear is None for m in layers)


def test_the_engine_with_int8_dot_products_is_batch_invariant_and_close_to_fp32(ext, tiny_model_dir):
    """cpu_weights=int8-dot: each sequence alone equals the batch (prefill chunks, decode steps through
    the fused ops on packed weights, the model file's path for the tied head), and the logits stay
    within x's rounding of the fp32 model's."""
    model, note = _tiny_4_bit(tiny_model_dir, "int8-dot")
    assert note == "quantized layers kept packed (4-bit x 15, int8 dot products)"
    eng = PagedEngine(model, num_blocks=64, matmul="pool", chunk_schedule=SMALL_CHUNKS)
    assert "on packed weights" in eng.decode_path, eng.decode_path
    prompts = [[1, 17, 250, 9, 400, 33, 700, 5, 64, 128, 900, 12, 3, 511] * 3, [5, 9, 13], [700, 2]]
    specs = [SeqSpec(f"i{i}", p, 12, stop_token_ids=()) for i, p in enumerate(prompts)]
    together, _, _ = run(eng, specs)
    for s in specs:
        assert run(eng, [s])[0][s.uid] == together[s.uid], s.uid
    # speculating at every step (a verify pass over several positions a row, through the model file's
    # ops, against the decode step's fused ones): the same tokens
    spec = PagedEngine(model, num_blocks=64, matmul="pool", chunk_schedule=SMALL_CHUNKS, speculate="ngram")
    spec.speculator.costs.always = True
    assert run(spec, specs)[0] == together and spec.stats()["verify_passes"] > 0
    dense, _ = _tiny_4_bit(tiny_model_dir, "fp32")
    ids = mx.array([prompts[0]])
    got, want = model(ids), dense(ids)
    assert not mx.array_equal(got, want).item()  # the other kernel ran
    spread = mx.max(want) - mx.min(want)
    assert mx.max(mx.abs(got - want)).item() < 0.05 * spread.item()


def test_the_decode_forward_keeps_the_packed_buffers_views(ext, tiny_model_dir, monkeypatch):
    """The engine gathers the model's parameters into huge-page buffers (hugepages.pack) before it builds
    its decode forward, which keeps each packed layer's scales and biases: it holds the buffers' views,
    the model's own arrays, not the arrays they replaced (a second copy, on small pages)."""
    from mlxq.worker.engine import hugepages

    monkeypatch.setattr(hugepages, "_thp_on", lambda: True)
    monkeypatch.setattr(hugepages, "HUGE", 4096)  # the tiny model's parameters fill "huge" buffers
    monkeypatch.setattr(hugepages, "advise", lambda arrays: 0)  # only the packing is checked here
    model, _ = _tiny_4_bit(tiny_model_dir, "int8-dot")
    before = model.model.layers[0].self_attn.q_proj["scales"]
    fwd = PagedEngine(model, num_blocks=16, matmul="pool").runner.decode_forward
    assert model.model.layers[0].self_attn.q_proj["scales"] is not before  # packed: a view now
    for L, layer in zip(fwd.layers, model.model.layers):
        assert L.attn_packing["qscales"][0] is layer.self_attn.q_proj["scales"]
        assert L.mlp_packing["qbiases"][3] is layer.mlp.down_proj["biases"]


def test_cpu_weights_is_a_checked_setting(tiny_model_dir):
    assert Settings().cpu_weights == "fp32"
    assert Settings.from_env(cpu_weights="quantized").cpu_weights == "quantized"
    assert Settings.from_env(cpu_weights="int8-dot").cpu_weights == "int8-dot"
    with pytest.raises(ValueError, match="cpu_weights"):
        Settings.from_env(cpu_weights="int4")
    with pytest.raises(ValueError, match="cpu_weights must be one of fp32, quantized, int8-dot"):
        load_model(str(tiny_model_dir), cpu_weights="int4")


def test_the_generic_loops_give_the_avx2_bits(ext, tmp_path):
    """The fallback for a CPU without AVX2+FMA emulates the 8 lanes with the same operations: a fresh
    process forced onto it (MLXQ_ATTN_ISA=generic) computes the very same outputs, int8_dot's too, on
    float32, fp16 and bf16 scales (here from AVX-VNNI's or AVX2's integer dot products), with a row's
    last chunk of 8 blocks whole, short by an even or an odd count, and groups of 1, 2 and 4 blocks."""
    if ext.qlinear_isa() != "avx2":
        pytest.skip("this CPU has no AVX2+FMA: only the generic loops run here")
    cases, runs = {}, []  # runs: (x, weight, scales, biases, group, bits, int8_dot) as names in cases
    for bits in (4, 8):
        for K, group in ((384, 32), (352, 32), (320, 64), (384, 128)):
            at = f"{bits}_{K}_{group}"
            wq, scales, biases, _ = _quantized(40, K, bits, group, bits + K + group)
            cases.update({f"w{at}": wq, f"s{at}": scales, f"b{at}": biases})
            cases[f"x{K}"] = mx.random.normal((3, K), key=mx.random.key(K))
            runs += [(f"x{K}", f"w{at}", f"s{at}", f"b{at}", group, bits, i8) for i8 in (False, True)]
            for dtype in ("float16", "bfloat16"):
                _, (cases[f"s{at}{dtype}"], cases[f"b{at}{dtype}"]) = _as(getattr(mx, dtype), scales, biases)
                runs.append((f"x{K}", f"w{at}", f"s{at}{dtype}", f"b{at}{dtype}", group, bits, True))
    mx.savez(str(tmp_path / "q.npz"), **cases)
    want = mx.concatenate([ext.quantized_linear(cases[x], cases[w], cases[s], cases[b], g, bits, i8).reshape(-1)
                           for x, w, s, b, g, bits, i8 in runs])
    mx.save(str(tmp_path / "want.npy"), want)
    script = (
        "import os\n"
        "from mlxq.worker import blas; blas.setup()\n"
        "import mlx.core as mx\n"
        "from mlxq.worker.engine import attention\n"
        "ext = attention.cpu_extension()\n"
        "assert (ext.qlinear_isa(), ext.qdot_isa()) == ('generic', 'generic')\n"
        f"c, want = mx.load({str(tmp_path / 'q.npz')!r}), mx.load({str(tmp_path / 'want.npy')!r})\n"
        f"got = mx.concatenate([ext.quantized_linear(c[x], c[w], c[s], c[b], g, bits, i8).reshape(-1)\n"
        f"                      for x, w, s, b, g, bits, i8 in {runs!r}])\n"
        "assert mx.array_equal(got, want).item()\n"
        # checked: skip the interpreter's teardown, where MLX's and the pool's threads once ended the
        # process with "terminate called without an active exception" after the check had passed
        "os._exit(0)\n"
    )
    env = {**os.environ, "MLXQ_ATTN_ISA": "generic"}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300,
                          cwd=str(tmp_path))  # not the checkout: its mlxq/ would shadow the installed one
    assert proc.returncode == 0, proc.stderr[-2000:]
