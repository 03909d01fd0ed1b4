"""decode_forward.DecodeForward: a decode step straight from the extension's ops gives the model
file's logits bit for bit (float and quantized pools, rows at one position or at many, llama and
qwen2 with its biases), and the engine keeps the model file wherever it does not apply."""

import mlx.core as mx
import pytest
from mlx_lm.models import qwen2

from mlxq.worker.engine import PagedEngine
from mlxq.worker.engine.decode_forward import DecodeForward, attn_in_ops, fused_exact, mlp_block_ops
from mlxq.worker.engine.kv_cache import BatchRow
from mlxq.worker.engine.api import SeqSpec

from enginekit import random_llama, run


def random_qwen2(seed: int):
    """A 2-layer qwen2 (biased q/k/v, tied head) with random weights, evaluated."""
    mx.random.seed(seed)
    m = qwen2.Model(qwen2.ModelArgs(
        model_type="qwen2", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, vocab_size=256,
        rope_theta=1e6, tie_word_embeddings=True))
    mx.eval(m.parameters())
    return m


def engine_with_fast_path(model, **kw) -> PagedEngine:
    eng = PagedEngine(model, num_blocks=64, **kw)
    if eng.runner.decode_forward is None:
        pytest.skip(f"decode_forward does not apply on this machine: {eng.decode_path}")
    return eng


def decoding(eng, prompts: list[list[int]]):
    """The engine's sequences once every one decodes, with nothing in flight."""
    eng.add([SeqSpec(f"s{i}", p, 50, stop_token_ids=()) for i, p in enumerate(prompts)])
    for _ in range(200):
        eng.step()
        seqs = list(eng.scheduler.running.values())
        if len(seqs) == len(prompts) and all(s.status.value == "decode" for s in seqs):
            break
    eng.runner.take_inflight()
    return seqs


def both_logits(eng, seqs):
    """The step's logits through the model file, then through DecodeForward (the second writes
    the same K/V rows into the same slots again)."""
    batch = [BatchRow(s.block_table, s.num_computed, 1) for s in seqs]
    inputs = mx.array([[s.tokens[-1]] for s in seqs], dtype=mx.int32)
    stock = eng.runner.forward(batch, inputs)
    mx.eval(stock, eng.pool.arrays())
    fast = eng.runner.head(eng.runner.decode_forward(batch, inputs))
    mx.eval(fast, eng.pool.arrays())
    return stock, fast


@pytest.mark.parametrize("kv_bits", [None, 8, 4])
@pytest.mark.parametrize("lengths", [[37], [5, 40, 33, 70], [21, 21, 21]], ids=["one", "ragged", "aligned"])
def test_logits_bit_for_bit_llama(kv_bits, lengths):
    kw = {} if kv_bits is None else dict(kv_bits=kv_bits, kv_group_size=32)
    eng = engine_with_fast_path(random_llama(11, hidden_size=128), **kw)  # head dim 32: a KV group
    seqs = decoding(eng, [[(7 * i + 3 * n) % 250 + 1 for i in range(n)] for n in lengths])
    stock, fast = both_logits(eng, seqs)
    assert stock.shape == fast.shape == (len(lengths), 256)
    assert mx.array_equal(stock, fast).item()


def test_logits_bit_for_bit_qwen2_biases():
    eng = engine_with_fast_path(random_qwen2(12))
    seqs = decoding(eng, [[(5 * i + n) % 250 + 1 for i in range(n)] for n in (9, 50, 31)])
    stock, fast = both_logits(eng, seqs)
    assert mx.array_equal(stock, fast).item()


def test_engine_output_equal_with_and_without():
    """Whole runs, with preemption on a small pool: the same greedy tokens either way."""
    model = random_llama(13)
    prompts = [[(11 * i + n) % 250 + 1 for i in range(n)] for n in (12, 45, 30, 64, 8)]
    specs = [SeqSpec(f"r{i}", p, 40, stop_token_ids=()) for i, p in enumerate(prompts)]
    outs = []
    for fast in (False, True):
        eng = PagedEngine(model, num_blocks=14, pressure=1.0)
        if fast and eng.runner.decode_forward is None:
            pytest.skip(f"decode_forward does not apply on this machine: {eng.decode_path}")
        if not fast:
            eng.runner.decode_forward = None
        out, done, _ = run(eng, specs)
        assert set(done) == {s.uid for s in specs}
        outs.append(out)
    assert outs[0] == outs[1]


def test_steps_aside_where_it_does_not_apply():
    model = random_llama(14)
    eng = PagedEngine(model, num_blocks=16, matmul="mlx")
    assert eng.runner.decode_forward is None and "op" in eng.decode_path
    gather = PagedEngine(model, num_blocks=16, attention="gather")
    assert gather.runner.decode_forward is None and "gather" in gather.decode_path


def test_follows_ops_installed_later_on_the_same_model():
    """An engine made later on the same model with MLX's matmul changes what the model file runs;
    the earlier engine's fast path then steps aside rather than keep the extension's matmul."""
    model = random_llama(15)
    first = engine_with_fast_path(model)
    assert first.runner.decode_forward.current()
    PagedEngine(model, num_blocks=16, matmul="mlx")
    assert not first.runner.decode_forward.current()
    out, done, _ = run(first, [SeqSpec("a", [3, 4, 5, 6], 6, stop_token_ids=())])
    assert len(out["a"]) == 6 and done == {"a": "length"}
    assert DecodeForward.build(model, first.pool, first.attention)[0] is None


def test_steps_aside_for_weights_that_are_not_float32():
    """The model file's ops fall back to MLX's own for other dtypes; so does the whole step."""
    model = random_llama(16)
    eng = engine_with_fast_path(model)
    model.set_dtype(mx.bfloat16)
    assert DecodeForward.build(model, eng.pool, eng.attention) == (None, "weights that are not float32")
    bf16 = PagedEngine(model, num_blocks=16)
    assert bf16.runner.decode_forward is None
    out, done, _ = run(bf16, [SeqSpec("a", [3, 4, 5, 6], 4, stop_token_ids=())])
    assert len(out["a"]) == 4


@pytest.mark.parametrize("off", [["attn_in"], ["mlp_block"], ["attn_in", "mlp_block"]])
def test_logits_bit_for_bit_without_fused_ops(off):
    """Where the extension's fused ops are not used (an older build, or a check failed), the
    layers' separate ops give the same bits too."""
    eng = engine_with_fast_path(random_qwen2(17))
    for name in off:
        setattr(eng.runner.decode_forward, name, None)
    seqs = decoding(eng, [[(3 * i + n) % 250 + 1 for i in range(n)] for n in (9, 50)])
    stock, fast = both_logits(eng, seqs)
    assert mx.array_equal(stock, fast).item()


def _ext_with_mlp_block():
    """The CPU extension (its linear's BLAS set, as an engine sets it); a failed check of a fused
    op fails here, not as a skip."""
    eng = engine_with_fast_path(random_llama(18))
    ext = eng.runner.decode_forward.ext
    for name in ("attn_in", "mlp_block"):
        assert fused_exact(ext, name), f"the extension's {name} differs from its separate ops"
        assert getattr(eng.runner.decode_forward, name) is not None and name in eng.decode_path
    return ext


@pytest.mark.parametrize("rows", [1, 64])  # 64 x 512 floats: the adds, norm and swiglu split over the pool
def test_mlp_block_is_its_ops_one_after_another(rows):
    ext = _ext_with_mlp_block()
    D, K, I = 512, 384, 704
    keys = iter(mx.random.split(mx.random.key(rows), 12))
    r = lambda *shape: mx.random.normal(shape, key=next(keys))  # noqa: E731
    w_o = r(K, D).T  # a transposed view: the weight read by columns, as linear reads it
    ln, w_g, w_u, w_d = r(D), r(I, D), r(I, D), r(D, I)
    h, o = r(rows, 1, D), r(rows, 1, K)
    for biases in ([None, r(I), r(I), None], [r(D), None, None, r(D)], [None] * 4):
        args = (h, o, w_o, ln, 1e-6, w_g, w_u, w_d, biases)
        got, want = ext.mlp_block(*args), mlp_block_ops(ext, *args)  # the separate ops: the fallback's
        assert got.shape == h.shape
        assert mx.array_equal(got, want).item()


def test_mlp_block_refuses_bad_shapes_clearly():
    ext = _ext_with_mlp_block()
    h, o = mx.zeros((2, 1, 8)), mx.zeros((2, 1, 8))
    w, ln, wi = mx.zeros((8, 8)), mx.zeros((8,)), mx.zeros((16, 8))
    with pytest.raises(ValueError, match="w_down must be float32 \\(8, 16\\)"):
        ext.mlp_block(h, o, w, ln, 1e-6, wi, wi, wi, [None] * 4)
    with pytest.raises(ValueError, match="biases is"):
        ext.mlp_block(h, o, w, ln, 1e-6, wi, wi, mx.zeros((8, 16)), [None])
    with pytest.raises(ValueError, match="same rows"):
        ext.mlp_block(h, mx.zeros((3, 1, 8)), w, ln, 1e-6, wi, wi, mx.zeros((8, 16)), [None] * 4)


@pytest.mark.parametrize("rows,dims,traditional", [(1, 64, False), (64, 32, True)])
def test_attn_in_is_its_ops_one_after_another(rows, dims, traditional):
    ext = _ext_with_mlp_block()
    D, H, KH, hd = 512, 8, 2, 64
    keys = iter(mx.random.split(mx.random.key(rows), 12))
    r = lambda *shape: mx.random.normal(shape, key=next(keys))  # noqa: E731
    ln, h = r(D), r(rows, 1, D)
    ws = [r(H * hd, D), r(D, KH * hd).T, r(KH * hd, D)]  # k's weight a transposed view
    offsets = mx.array([(4099 * i + 7) % 70000 for i in range(rows)], dtype=mx.int32)  # some past RoPE's table
    rope = (dims, traditional, 10000.0, 1.0)
    for biases in ([], [r(H * hd), r(KH * hd), r(KH * hd)]):
        args = (h, ln, 1e-5, ws, biases, H, KH, *rope, offsets)
        got, want = ext.attn_in(*args), attn_in_ops(ext, *args)  # the separate ops: the fallback's
        assert [g.shape for g in got] == [(rows, H, 1, hd), (rows, KH, 1, hd), (rows, KH, 1, hd)]
        for g, w in zip(got, want):
            assert mx.array_equal(g, w).item()


def test_attn_in_refuses_bad_input_clearly():
    ext = _ext_with_mlp_block()
    h, ln, off = mx.zeros((2, 1, 8)), mx.zeros((8,)), mx.array([0, 1])
    ws = [mx.zeros((8, 8)), mx.zeros((4, 8)), mx.zeros((4, 8))]
    with pytest.raises(ValueError, match="h must be float32 \\(B, 1, D\\)"):
        ext.attn_in(mx.zeros((2, 3, 8)), ln, 1e-5, ws, [], 2, 1, 4, False, 1e4, 1.0, off)
    with pytest.raises(ValueError, match="one head dim"):
        ext.attn_in(h, ln, 1e-5, ws, [], 4, 1, 2, False, 1e4, 1.0, off)
    with pytest.raises(ValueError, match="rope dims"):
        ext.attn_in(h, ln, 1e-5, ws, [], 2, 1, 6, False, 1e4, 1.0, off)
    with pytest.raises(ValueError, match="offsets"):
        ext.attn_in(h, ln, 1e-5, ws, [], 2, 1, 4, False, 1e4, 1.0, mx.array([0, 1, 2]))


def test_a_fused_op_that_fails_its_check_is_not_used(monkeypatch, caplog):
    """A fused op whose check raises (or differs) leaves the layers on the separate ops: the
    engine still builds, logs why, and gives the model file's bits."""
    import mlxq.worker.engine.decode_forward as df

    def broken(ext):
        raise RuntimeError("planted")

    monkeypatch.setattr(df, "_EXACT", {})
    monkeypatch.setitem(df._CHECKS, "attn_in", broken)
    monkeypatch.setitem(df._CHECKS, "mlp_block", lambda ext: False)
    eng = engine_with_fast_path(random_qwen2(19))
    fwd = eng.runner.decode_forward
    assert fwd.attn_in is None and fwd.mlp_block is None and "fused" not in eng.decode_path
    assert "attn_in failed its check" in caplog.text and "mlp_block differs" in caplog.text
    seqs = decoding(eng, [[(3 * i + n) % 250 + 1 for i in range(n)] for n in (9, 40)])
    stock, fast = both_logits(eng, seqs)
    assert mx.array_equal(stock, fast).item()
