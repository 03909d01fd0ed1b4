"""Quantized KV blocks (--kv-bits 8 / 4): the pool's write and dequantization, the fused
op on quantized blocks against a float reference and the gather path, and the engine's
block-level features (prefix hits, preemption, sessions) with quantized blocks, each
against an uninterrupted run of the same quantized engine."""

import random

import mlx.core as mx
import numpy as np
import pytest

from mlxq.shared.settings import Settings
from mlxq.worker.engine import PagedEngine, attention
from mlxq.worker.engine.attention import gather_attention
from mlxq.worker.engine.api import SeqSpec
from mlxq.worker.engine.kernels import model_ops
from mlxq.worker.engine.kv_cache import KVPool, KVQuant, probe_kv_shape

from enginekit import random_llama, run, warm_count

BS = 32
GROUP = 32


@pytest.fixture(scope="module")
def ext():
    return attention.cpu_extension()


@pytest.fixture(scope="module")
def model():
    """A random llama with 32-wide heads (so 32-element groups fit), GQA 4:2."""
    return random_llama(5, hidden_size=128)


def _prompts(seed, n, lo, hi):
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _engine(model, bits, **kw):
    return PagedEngine(model, kv_bits=bits, kv_group_size=GROUP, **kw)


def _solo(model, bits, spec):
    """The reference: the same quantized engine config, the job alone, a pool it never fills."""
    out, _, n_pre = run(_engine(model, bits, num_blocks=64), [SeqSpec("solo", spec.prompt, spec.max_tokens)])
    assert n_pre == 0
    return out["solo"]


# ------------------------------------------------------------------ the pool
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("in_place", [True, False], ids=["kv_write", "scatter"])
def test_blocks_round_trip_no_worse_than_mx_quantize(ext, model, bits, in_place):
    """Written rows read back as KVQuant.quantize makes them (bit for bit): mx.quantize's
    integers with each group's least-squares scale and bias, so no group's squared error is
    above mx.quantize's own (up to fp32 rounding), and the rows' total error is below it."""
    shape = probe_kv_shape(model)
    quant = KVQuant(bits, GROUP)
    pool = KVPool(shape, 6, BS, quant=quant)
    pool.kv_write = ext.paged_kv_write if in_place else None
    s = shape.layers[0]
    keys = mx.random.normal((2, s.n_kv_heads, 5, s.k_head_dim), key=mx.random.key(1)) * 3
    values = mx.random.normal((2, s.n_kv_heads, 5, s.v_head_dim), key=mx.random.key(2))
    slots = mx.array([33, 34, 35, 36, 37, 64, 65, 66, 67, 68], dtype=mx.int32)
    pool.write_rows(0, keys, values, slots)
    mx.eval(pool.arrays())
    for side, x in (("k", keys), ("v", values)):
        H, D = x.shape[1], x.shape[3]
        want = x.transpose(1, 0, 2, 3).reshape(H, -1, D)
        got = pool.dequantize(side, 0, lambda a: a[:, slots])
        ours = mx.dequantize(*quant.quantize(want, mx.float32), group_size=GROUP, bits=bits)
        assert mx.array_equal(got, ours).item()
        theirs = mx.dequantize(*mx.quantize(want, group_size=GROUP, bits=bits), group_size=GROUP, bits=bits)

        def group_sse(y):
            return ((y - want) ** 2).reshape(H, -1, D // GROUP, GROUP).sum(axis=-1)

        sse, sse_mx = group_sse(got), group_sse(theirs)
        assert mx.all(sse <= sse_mx * (1 + 1e-4) + 1e-12).item()
        assert sse.sum().item() < sse_mx.sum().item()


def test_quantize_keeps_a_constant_group_and_each_rows_bits_alone():
    """A group of one repeated value keeps mx.quantize's map (no spread to fit a line to); a row
    quantized alone has the bits it has among others (prefill and decode write the same blocks)."""
    for bits in (8, 4):
        quant = KVQuant(bits, GROUP)
        x = mx.random.normal((3, 2, 4, 2 * GROUP), key=mx.random.key(5))
        x[1, 0, 2, :GROUP] = 0.75
        xq, sc, bi = quant.quantize(x, mx.float32)
        back = mx.dequantize(xq, sc, bi, group_size=GROUP, bits=bits)
        assert mx.allclose(back[1, 0, 2, :GROUP], mx.full((GROUP,), 0.75), atol=1e-6).item()
        alone = quant.quantize(x[2:3, 1:2, 3:4], mx.float32)
        for a, b in zip(alone, (xq, sc, bi)):
            assert mx.array_equal(a, b[2:3, 1:2, 3:4]).item()


def test_extension_quantize_is_the_mlx_ops_bit_for_bit(ext, model):
    """The extension's kv_quantize (one primitive) gives KVQuant.quantize's MLX ops' bits, on keys
    as the model hands them over (heads transposed: strided rows), and a fused engine's pool
    writes with it."""
    assert model_ops.check_kv_quantize(ext)
    x = mx.random.normal((3, 7, 4, 64), key=mx.random.key(21)).transpose(0, 2, 1, 3) * 2
    for bits in (8, 4):
        for group in (32, 64):
            q = KVQuant(bits, group)
            got, want = q.quantize(x, mx.float32, ext.kv_quantize), q.quantize(x, mx.float32)
            assert all(mx.array_equal(a, b).item() for a, b in zip(got, want))
    assert _engine(model, 8, num_blocks=8).pool.kv_quantize is not None
    assert _engine(model, 8, num_blocks=8, attention="gather").pool.kv_quantize is None


def test_kv_quantize_refuses_bad_input(ext):
    x = mx.random.normal((2, 64))
    xq, s, b = mx.quantize(x, group_size=64, bits=8)
    for args, words in (((x, xq, s, b, 64, 3, 2), "bits"), ((x, xq, s, b, 48, 8, 2), "group_size"),
                        ((x, xq, s, b, 64, 8, 9), "rounds"), ((x, xq, s[:1], b, 64, 8, 2), "outputs"),
                        ((x.astype(mx.float16), xq, s, b, 64, 8, 2), "float32")):
        with pytest.raises(ValueError, match=words):
            ext.kv_quantize(*args)


def test_pool_counts_every_array_and_spills_them(model):
    shape = probe_kv_shape(model)
    q = KVQuant(8, GROUP)
    pool = KVPool(shape, 10, BS, quant=q)
    assert pool.nbytes == 11 * shape.bytes_per_block(BS, quant=q)
    assert len(pool.arrays()) == 6 * len(shape.layers)
    assert all(a.shape[1] == 11 * BS for a in pool.arrays())  # every array indexed by slot
    data = {k: mx.random.randint(0, 2**31, v.shape).astype(v.dtype) for k, v in pool.read_blocks([1, 2]).items()}
    pool.write_blocks([5, 3], data)
    back = pool.read_blocks([5, 3])
    assert set(back) == set(data) and all(mx.array_equal(back[k], data[k]).item() for k in data)
    float_bytes = shape.bytes_per_block(BS)
    assert float_bytes / shape.bytes_per_block(BS, quant=q) >= 1.9
    assert float_bytes / shape.bytes_per_block(BS, quant=KVQuant(4, GROUP)) >= 3.5


# ------------------------------------------------------------------ the op
def _case(seed, bits, D=64, Hq=4, Hkv=2, ctx=(70, 9, 100), n_new=(1, 9, 3)):
    rng = np.random.default_rng(seed)
    nb = max(-(-c // BS) for c in ctx)
    num_blocks = len(ctx) * nb + 3
    tables = mx.array(rng.permutation(num_blocks)[: len(ctx) * nb].reshape(len(ctx), nb).astype(np.int32))
    k = mx.array(rng.standard_normal((Hkv, num_blocks * BS, D), dtype=np.float32))
    v = mx.array(rng.standard_normal((Hkv, num_blocks * BS, D), dtype=np.float32))
    q = mx.array(rng.standard_normal((len(ctx), Hq, max(n_new), D), dtype=np.float32))
    kq, ks, kb = mx.quantize(k, group_size=GROUP, bits=bits)
    vq, vs, vb = mx.quantize(v, group_size=GROUP, bits=bits)
    quant = dict(k_scales=ks, k_biases=kb, v_scales=vs, v_biases=vb, bits=bits, group_size=GROUP)
    rest = (tables, mx.array([c - n for c, n in zip(ctx, n_new)], dtype=mx.int32),
            mx.array(ctx, dtype=mx.int32), D ** -0.5)
    return q, (k, v), (kq, vq), rest, quant, n_new


def _real(x, n_new):
    return [x[b, :, :n] for b, n in enumerate(n_new)]


@pytest.mark.parametrize("bits", [8, 4])
def test_fused_on_quantized_blocks_vs_float_reference(ext, bits):
    """Within the error the quantization step allows: keys off by <= s_k/2 move each score by
    at most delta = scale * |q|_1 * s_k / 2, so the softmax weights by a factor within e^(+-2 delta),
    and values off by <= s_v/2 add at most s_v/2."""
    q, (k, v), (kq, vq), rest, quant, n_new = _case(3, bits)
    got = ext.paged_attention(q, kq, vq, *rest, **quant)
    want = gather_attention(q, k, v, *rest)
    scale = rest[-1]
    delta = scale * mx.abs(q).sum(axis=-1).max().item() * quant["k_scales"].max().item() / 2
    tol = quant["v_scales"].max().item() / 2 + mx.abs(v).max().item() * (np.exp(2 * delta) - 1)
    for g, w in zip(_real(got, n_new), _real(want, n_new)):
        assert mx.abs(g - w).max().item() <= tol
    # and the quantized blocks do change the output (the test would catch a float read)
    assert max(mx.abs(g - w).max().item() for g, w in zip(_real(got, n_new), _real(want, n_new))) > 0


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("window", [None, 40])
def test_fused_equals_gather_on_the_same_quantized_pool(ext, bits, window):
    q, _, (kq, vq), rest, quant, n_new = _case(4, bits)
    got = ext.paged_attention(q, kq, vq, *rest, window, **quant)
    want = gather_attention(q, kq, vq, *rest, window, **quant)
    for g, w in zip(_real(got, n_new), _real(want, n_new)):
        assert mx.abs(g - w).max().item() <= 1e-4 * (1 + mx.abs(w).max().item())


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("group", [32, 64])
def test_rows_sharing_quantized_blocks_get_their_solo_bits(ext, bits, group):
    """Rows on the same blocks (the n samples of a prompt, prefix hits) take them in one task,
    whose queries read the blocks' integers from a float copy made once; a row alone reads its
    packed rows directly. Either way a query's arithmetic is the same: the same bits."""
    rng = np.random.default_rng(11)
    D, Hq, Hkv, ctx, rows = 64, 4, 2, 75, 5
    nb = -(-ctx // BS)
    k = mx.array(rng.standard_normal((Hkv, (nb + 1) * BS, D), dtype=np.float32))
    v = mx.array(rng.standard_normal((Hkv, (nb + 1) * BS, D), dtype=np.float32))
    kq, ks, kb = mx.quantize(k, group_size=group, bits=bits)
    vq, vs, vb = mx.quantize(v, group_size=group, bits=bits)
    quant = dict(k_scales=ks, k_biases=kb, v_scales=vs, v_biases=vb, bits=bits, group_size=group)
    q = mx.array(rng.standard_normal((rows, Hq, 1, D), dtype=np.float32))
    table = list(range(nb))

    def op(qs, n):
        return ext.paged_attention(qs, kq, vq, mx.array([table] * n, dtype=mx.int32),
                                   mx.array([ctx - 1] * n, dtype=mx.int32), mx.array([ctx] * n, dtype=mx.int32),
                                   D ** -0.5, **quant)

    together = op(q, rows)
    for b in range(rows):
        assert mx.array_equal(together[b], op(q[b:b + 1], 1)[0]).item(), b


def test_op_refuses_bad_quantized_input(ext):
    q, _, (kq, vq), rest, quant, _ = _case(5, 8)
    with pytest.raises(ValueError, match="bits must be 4 or 8"):
        ext.paged_attention(q, kq, vq, *rest, **{**quant, "bits": 3})
    with pytest.raises(ValueError, match="group_size"):
        ext.paged_attention(q, kq, vq, *rest, **{**quant, "group_size": 24})
    with pytest.raises(ValueError, match="scales and biases"):
        ext.paged_attention(q, kq, vq, *rest, **{**quant, "v_biases": quant["v_biases"][:1]})
    with pytest.raises(ValueError, match="packed uint32"):
        ext.paged_attention(q, kq.astype(mx.float32), vq, *rest, **quant)


# ------------------------------------------------------------------ the engine
def test_fused_and_gather_engines_agree_on_quantized_blocks(ext, model):
    prompts = _prompts(1, 4, 5, 90)
    specs = [SeqSpec(f"s{i}", p, 10) for i, p in enumerate(prompts)]
    outs = [run(_engine(model, 8, num_blocks=48, attention=mode), specs)[0] for mode in ("fused", "gather")]
    assert outs[0] == outs[1]


@pytest.mark.parametrize("bits", [8, 4])
def test_prefix_hits_and_batching_give_the_solo_tokens(ext, model, bits):
    system = _prompts(2, 1, 70, 70)[0]
    specs = [SeqSpec(f"q{i}", system + q, 8) for i, q in enumerate(_prompts(3, 4, 1, 20))]
    eng = _engine(model, bits, num_blocks=48)
    run(eng, [SeqSpec("warm", system + [7], 2)])
    out, _, _ = run(eng, specs)
    assert eng.stats()["prefix_hit_tokens"] == 64 * len(specs)
    for s in specs:
        assert out[s.uid] == _solo(model, bits, s), s.uid


def test_preemption_resume_gives_the_uninterrupted_tokens(ext, model):
    prompts = _prompts(5, 5, 20, 60)
    eng = _engine(model, 8, num_blocks=12, pressure=1.0, chunk_schedule=((64, 24), (None, 16)))
    # speculating at every step a row has a proposal: a schedule that does not follow step times (the test
    # needs its preemption), with the verify passes in it
    eng.speculator.costs.always = True
    specs = [SeqSpec(f"p{i}", p, 30, priority=float(i % 3)) for i, p in enumerate(prompts)]
    before = ext.kv_write_copies()
    out, _, n_pre = run(eng, specs)
    assert n_pre > 0 and eng.stats()["verify_passes"] > 0
    assert eng.pool.kv_write is not None and ext.kv_write_copies() == before  # packed rows written in place
    for s in specs:
        assert out[s.uid] == _solo(model, 8, s), s.uid


def test_session_spill_and_restore_with_quantized_blocks(ext, model, tmp_path):
    turn1 = _prompts(12, 1, 80, 80)[0]
    eng = _engine(model, 4, num_blocks=32, session_dir=str(tmp_path), model_id="m")
    out, _, _ = run(eng, [SeqSpec("t1", turn1, 20, session_id="chat")])
    eng.close()  # spills the session's blocks (packed values, scales, biases)
    assert warm_count(eng.sessions.session_dir) == 1
    turn2 = turn1 + out["t1"] + [1, 2, 3]
    eng2 = _engine(model, 4, num_blocks=32, session_dir=str(tmp_path), model_id="m")
    out2, _, _ = run(eng2, [SeqSpec("t2", turn2, 6, session_id="chat")])
    assert eng2.stats()["session_restores"] == 1 and eng2.stats()["prefix_hit_tokens"] == 96
    assert out2["t2"] == _solo(model, 4, SeqSpec("x", turn2, 6))
    # a pool of another layout does not load the file (it would be garbage)
    eng3 = _engine(model, 8, num_blocks=32, session_dir=str(tmp_path), model_id="m")
    run(eng3, [SeqSpec("t3", turn2, 2, session_id="chat")])
    assert eng3.stats()["session_restores"] == 0


# ------------------------------------------------------------------ bad settings
@pytest.mark.parametrize("field,value,words", [
    ("kv_bits", 3, "only 4 or 8 bit"), ("kv_bits", 16, "only 4 or 8 bit"),
    ("kv_group_size", 48, "must be 32, 64 or 128")])
def test_bad_bits_or_group_refused_by_settings(field, value, words):
    with pytest.raises(ValueError, match=words):
        Settings(**{field: value})


def test_group_that_does_not_divide_the_head_dim_is_refused(model):
    with pytest.raises(ValueError, match=r"kv_group_size=64 does not divide the model's head dims \[32\]"):
        PagedEngine(model, num_blocks=8, kv_bits=8, kv_group_size=64)
