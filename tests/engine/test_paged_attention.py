"""The paged attention op: the CPU extension against the plain-MLX reference on random
shapes, its build, the fallback when it cannot load, and the engine with the op on vs off.

The first test that needs the extension builds it (file-locked, into $MLXQ_CACHE_DIR/ext
or ~/.cache/mlxq/ext), about 20-40 s once per mlx version and source.
"""

import logging
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.base import create_attention_mask, scaled_dot_product_attention

from mlxq.worker.engine.api import SeqSpec
from mlxq.worker.engine import PagedEngine, attention
from mlxq.worker.engine.kernels import extbuild
from mlxq.worker.engine.attention import gather_attention
from mlxq.worker.engine.kernels.extbuild import ExtensionUnavailable
from repokit import KIT
from workerkit import neutral_cwd

BS = 32


@pytest.fixture(scope="module")
def ext():
    return attention.cpu_extension()


def _case(seed, B, Hq, Hkv, n_new, D, ctx, *, window=None, Dv=None, dtype=mx.float32, spare=7):
    """Random pools and a batch: row b has ctx[b] tokens, the last n_new[b] of them queried;
    queries are padded to max(n_new). Block ids are shuffled over a larger pool."""
    rng = np.random.default_rng(seed)
    Dv = Dv or D
    nb = max(-(-c // BS) for c in ctx)
    num_blocks = B * nb + spare
    perm = rng.permutation(num_blocks)[: B * nb].reshape(B, nb).astype(np.int32)
    N = max(n_new)
    k_pool = mx.array(rng.standard_normal((Hkv, num_blocks * BS, D), dtype=np.float32)).astype(dtype)
    v_pool = mx.array(rng.standard_normal((Hkv, num_blocks * BS, Dv), dtype=np.float32)).astype(dtype)
    q = mx.array(rng.standard_normal((B, Hq, N, D), dtype=np.float32)).astype(dtype)
    kv_lens = mx.array(ctx, dtype=mx.int32)
    q_off = mx.array([c - n for c, n in zip(ctx, n_new)], dtype=mx.int32)
    return (q, k_pool, v_pool, mx.array(perm), q_off, kv_lens, D ** -0.5, window), n_new


def _rel_err(got, want, n_new):
    """Max |got - want| over the real (unpadded) queries, relative to max |want|."""
    errs, scale = [], []
    for b, n in enumerate(n_new):
        g = got[b, :, :n].astype(mx.float32)
        w = want[b, :, :n].astype(mx.float32)
        errs.append(mx.max(mx.abs(g - w)).item())
        scale.append(mx.max(mx.abs(w)).item())
    return max(errs) / max(scale)


CASES = [
    # B, Hq, Hkv, n_new per row, D, ctx per row, window
    pytest.param(1, 8, 8, [1], 64, [1], None, id="decode-first-token"),
    pytest.param(4, 8, 4, [1] * 4, 64, [100, 33, 1000, 64], None, id="decode-gqa2-ragged"),
    pytest.param(3, 16, 4, [1] * 3, 128, [300, 31, 32], None, id="decode-gqa4-d128"),
    pytest.param(2, 8, 1, [1, 1], 64, [257, 2000], None, id="decode-gqa8"),
    pytest.param(16, 8, 4, [1] * 16, 64, list(range(40, 40 * 17, 40)), None, id="decode-batch16"),
    pytest.param(2, 8, 2, [1, 1], 64, [900, 70], 64, id="decode-window"),
    pytest.param(1, 4, 2, [37], 64, [37], None, id="prefill-first-chunk"),
    pytest.param(3, 8, 2, [7, 16, 3], 128, [100, 40, 300], None, id="prefill-ragged-gqa4"),
    pytest.param(3, 8, 8, [16, 16, 16], 64, [100, 40, 300], 50, id="prefill-window"),
    pytest.param(2, 4, 4, [64, 1], 64, [64, 500], 24, id="prefill-and-decode-window"),
    pytest.param(1, 4, 1, [1], 64, [4100], None, id="long-single-row-split"),
    pytest.param(1, 8, 2, [20], 64, [3000], 1000, id="long-prefill-split-window"),
]


@pytest.mark.parametrize("B,Hq,Hkv,n_new,D,ctx,window", CASES)
def test_op_equals_reference(ext, B, Hq, Hkv, n_new, D, ctx, window):
    args, n_new = _case(hash((B, Hq, D, tuple(ctx))) % 2**32, B, Hq, Hkv, n_new, D, ctx, window=window)
    got = ext.paged_attention(*args)
    want = gather_attention(*args)
    assert got.shape == want.shape == (B, Hq, max(n_new), D)
    assert _rel_err(got, want, n_new) <= 1e-5


def test_op_random_shapes(ext):
    rng = np.random.default_rng(11)
    for trial in range(25):
        Hkv = int(rng.choice([1, 2, 4]))
        G = int(rng.choice([1, 2, 4, 8]))
        D = int(rng.choice([16, 64, 128]))
        Dv = int(rng.choice([D, 32]))
        B = int(rng.integers(1, 6))
        ctx = [int(rng.integers(1, 700)) for _ in range(B)]
        n_new = [int(rng.integers(1, min(c, 40) + 1)) for c in ctx]
        window = None if rng.random() < 0.5 else int(rng.integers(1, 300))
        args, n_new = _case(trial, B, G * Hkv, Hkv, n_new, D, ctx, window=window, Dv=Dv)
        got = ext.paged_attention(*args)
        want = gather_attention(*args)
        assert _rel_err(got, want, n_new) <= 1e-5, (trial, B, G, Hkv, D, Dv, ctx, n_new, window)



@pytest.mark.parametrize("ctx", [100, 700, 2100])
def test_a_rows_bits_do_not_depend_on_its_batch_or_its_chunk(ext, ctx):
    """The engine's promise (batched greedy == solo, resumed == undisturbed) needs a row's attention
    output to be the same bits alone, in a batch of any size, and queried at decode (one token) or
    inside a prefill chunk. A long row is split over the pool's threads (split-K), and the split
    must not follow the batch: alone it has the threads to itself, in a batch it does not."""
    rng = np.random.default_rng(ctx)
    Hq, Hkv, D, n_chunk = 8, 2, 64, 20
    nb = -(-ctx // BS)
    others = 63
    num_blocks = nb * (others + 1) + 3
    perm = rng.permutation(num_blocks).astype(np.int32)
    k_pool = mx.array(rng.standard_normal((Hkv, num_blocks * BS, D), dtype=np.float32))
    v_pool = mx.array(rng.standard_normal((Hkv, num_blocks * BS, D), dtype=np.float32))
    tables = mx.array(perm[: nb * (others + 1)].reshape(others + 1, nb))
    q = mx.array(rng.standard_normal((others + 1, Hq, n_chunk, D), dtype=np.float32))

    def attend(rows, n, lens):
        """The last n queries of each row (row 0: its last n positions, others: as they come)."""
        q_off = mx.array([c - n for c in lens], dtype=mx.int32)
        return ext.paged_attention(q[rows][:, :, -n:], k_pool, v_pool, tables[rows], q_off,
                                   mx.array(lens, dtype=mx.int32), D ** -0.5)

    alone = attend(mx.array([0]), 1, [ctx])[0]
    lens = [ctx] + [int(x) for x in rng.integers(1, ctx + 1, size=others)]
    for batch in (2, 8, 64):
        got = attend(mx.arange(batch), 1, lens[:batch])[0]
        assert np.array_equal(np.array(got), np.array(alone)), batch
    # the same query as the last of a prefill chunk of 20 tokens, alone and in a batch
    chunk = attend(mx.array([0]), n_chunk, [ctx])[0, :, -1:]
    assert np.array_equal(np.array(chunk), np.array(alone))
    chunk = attend(mx.arange(8), n_chunk, [ctx] * 8)[0, :, -1:]
    assert np.array_equal(np.array(chunk), np.array(alone))


def _pools(rng, pool: str, Hkv: int, D: int, num_blocks: int):
    """Random K and V pools of one kind ("float32", "float16", "q8", "q4": group 32) and the op's
    quantization arguments for them."""
    k = mx.array(rng.standard_normal((Hkv, num_blocks * BS, D), dtype=np.float32))
    v = mx.array(rng.standard_normal((Hkv, num_blocks * BS, D), dtype=np.float32))
    quant = {}
    if pool.startswith("q"):
        bits = int(pool[1:])
        (k, ks, kb), (v, vs, vb) = (mx.quantize(x, group_size=32, bits=bits) for x in (k, v))
        quant = dict(k_scales=ks, k_biases=kb, v_scales=vs, v_biases=vb, bits=bits, group_size=32)
    elif pool == "float16":
        k, v = k.astype(mx.float16), v.astype(mx.float16)
    return k, v, quant


@pytest.mark.parametrize("pool,G", [("float32", 2), ("float32", 3), ("float16", 3), ("q8", 2), ("q4", 3)])
def test_rows_that_share_blocks_get_their_bits_alone(ext, pool, G):
    """Rows that start on the same pool blocks (the n samples of one prompt, prefix-cache hits) run
    as one task, each shared block read (and converted or dequantized) once for all of them. A
    row's output must be the bits it gets alone: forked rows of 1000 and 300 tokens with private
    last blocks, a row that shares only its first blocks, unrelated rows, prefill chunks; 2 and 3
    query heads per KV head."""
    rng = np.random.default_rng(11)
    Hkv, D, num_blocks = 4, 64, 200
    Hq = G * Hkv
    k, v, quant = _pools(rng, pool, Hkv, D, num_blocks)
    shared = list(range(40))  # a 1000-token prompt's 32 blocks and room to grow
    rows, lens = [], []
    for i in range(9):  # 9 forks (more than a task takes): private blocks from 31 on
        rows.append(shared[:31] + [100 + 3 * i, 101 + 3 * i, 102 + 3 * i])
        lens.append(1000 + 5 * i)
    rows.append(shared[:5] + [160, 161, 162, 163, 164, 165, 166, 167, 168, 169, 170, 171])  # shares 5
    lens.append(380)
    rows.append(list(range(180, 190)))  # unrelated
    lens.append(300)
    nb = max(len(r) for r in rows)
    tables = mx.array([r + [-1] * (nb - len(r)) for r in rows], dtype=mx.int32)
    q = mx.array(rng.standard_normal((len(rows), Hq, 7, D), dtype=np.float32))

    def attend(idx, n):
        sel = mx.array(idx)
        ln = [lens[i] for i in idx]
        return ext.paged_attention(q[sel][:, :, -n:], k, v, tables[sel], mx.array([c - n for c in ln], dtype=mx.int32),
                                   mx.array(ln, dtype=mx.int32), D ** -0.5, **quant)

    for n in (1, 7):
        together = np.array(attend(list(range(len(rows))), n))
        for i in range(len(rows)):
            alone = np.array(attend([i], n))[0]
            assert np.array_equal(together[i], alone), (pool, n, i)
    if not quant:
        args = (q[:, :, -1:], k, v, tables, mx.array([c - 1 for c in lens], dtype=mx.int32),
                mx.array(lens, dtype=mx.int32), D ** -0.5)
        assert _rel_err(ext.paged_attention(*args), gather_attention(*args), [1] * len(rows)) <= (
            1e-5 if pool == "float32" else 2e-3)


@pytest.mark.parametrize("dtype,tol", [(mx.float16, 2e-3), (mx.bfloat16, 1.6e-2)])
def test_half_precision_pools(ext, dtype, tol):
    args, n_new = _case(5, 3, 8, 4, [1, 5, 1], 64, [200, 77, 1500], dtype=dtype)
    got = ext.paged_attention(*args)
    assert got.dtype == dtype
    want = gather_attention(*args)
    assert _rel_err(got, want, n_new) <= tol


def test_padding_and_foreign_table_entries_are_safe(ext):
    """Padded queries and table entries past a row's length (even outside the pool)
    are never read; padded queries give finite values (zeros where they see nothing)."""
    args, n_new = _case(3, 2, 4, 2, [1, 6], 64, [40, 200], window=16)
    q, kp, vp, tables, q_off, kv_lens, scale, window = args
    t = np.array(tables)
    junk = [-5, 10**6, 2**31 - 1, -1, -(2**31)]
    t[0, 2:] = (junk * 4)[: t.shape[1] - 2]  # row 0 uses 2 blocks only
    got = ext.paged_attention(q, kp, vp, mx.array(t), q_off, kv_lens, scale, window)
    want = gather_attention(*args)
    assert _rel_err(got, want, n_new) <= 1e-5
    assert mx.all(mx.isfinite(got)).item()
    # a row that sees nothing at all: zeros
    none = ext.paged_attention(q, kp, vp, tables, q_off, mx.zeros_like(kv_lens), scale, None)
    assert mx.all(none == 0).item()


def test_bad_input_is_a_clear_error(ext):
    args, _ = _case(1, 2, 4, 2, [1, 1], 64, [10, 20])
    q, kp, vp, tables, q_off, kv_lens, scale, _ = args
    with pytest.raises(ValueError, match="multiple of KV heads"):
        ext.paged_attention(q[:, :3], kp, vp, tables, q_off, kv_lens, scale)
    with pytest.raises(ValueError, match="head dim"):
        ext.paged_attention(q[..., :32], kp, vp, tables, q_off, kv_lens, scale)
    with pytest.raises(ValueError, match="one row per batch row"):
        ext.paged_attention(q, kp, vp, tables, q_off[:1], kv_lens, scale)


# ------------------------------------------------------------------ build and fallback
def test_extension_is_built_in_the_cache_dir(ext):
    lib = extbuild.built_library()
    assert lib is not None and lib.parent == extbuild.ext_dir()
    assert extbuild.cache_root() in lib.parents
    assert ext.isa() in ("avx512vl", "avx2", "generic") and ext.num_threads() >= 1
    # `mlxq build-ext` finds it and says so (no rebuild)
    out = subprocess.run([sys.executable, "-m", "mlxq", "build-ext"], capture_output=True, text=True,
                         timeout=300, cwd=neutral_cwd())
    assert out.returncode == 0, out.stderr
    assert "extension ready" in out.stdout and str(lib) in out.stdout


def test_failed_build_is_reported_and_remembered(tmp_path, monkeypatch):
    monkeypatch.setenv("MLXQ_CACHE_DIR", str(tmp_path))

    def no_cmake():
        raise ExtensionUnavailable("no cmake >= 3.27 (forced by the test)")

    monkeypatch.setattr(extbuild, "find_cmake", no_cmake)
    with pytest.raises(ExtensionUnavailable, match="forced by the test"):
        extbuild.load()
    with pytest.raises(ExtensionUnavailable, match="mlxq build-ext"):  # not retried on every start
        extbuild.load()


@pytest.fixture
def broken_loader(monkeypatch):
    """The extension fails to load (as on a machine with no compiler)."""
    def fail(build_if_missing=True):
        raise ExtensionUnavailable("forced failure for the test")

    monkeypatch.setattr(extbuild, "load", fail)
    monkeypatch.setattr(attention, "_cpu_ext", None)
    monkeypatch.setattr(attention, "_cpu_error", None)


def test_fallback_to_gather_when_the_extension_fails(broken_loader, tiny_model, caplog):
    b = attention.select_backend("auto")
    assert b.name == "gather" and "forced failure" in b.reason and not b.fused
    with pytest.raises(ExtensionUnavailable):
        attention.select_backend("fused")
    with caplog.at_level(logging.INFO, logger="mlxq.worker.engine.attention"):
        eng = PagedEngine(tiny_model.model, num_blocks=32, attention="auto")
    assert eng.attention.name == "gather" and eng.pool.attention is None
    assert any("attention: gather" in r.getMessage() and "forced failure" in r.getMessage()
               for r in caplog.records)
    out = _greedy(eng, [[1, 2, 3, 4, 5]], 4)
    assert len(out["s0"]) == 4


def test_mode_from_settings_and_validation(monkeypatch):
    from mlxq.shared.settings import Settings

    monkeypatch.setenv("MLXQ_ATTENTION", "gather")  # read by Settings, the one reader of MLXQ_*
    assert attention.select_backend(Settings.from_env().attention).name == "gather"
    with pytest.raises(ValueError, match="auto, fused, gather"):
        attention.resolve_mode("fast")


# ------------------------------------------------------------------ the engine, op on vs off
def _greedy(engine, prompts, n):
    engine.add([SeqSpec(f"s{i}", p, n) for i, p in enumerate(prompts)])
    out = {f"s{i}": [] for i in range(len(prompts))}
    while engine.has_work():
        events, preempted = engine.step()
        assert not preempted
        for e in events:
            out[e.uid].append(e.token)
    return out


def test_engine_greedy_equal_fused_vs_gather(ext, tiny_model):
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(4, 1000, size=n)] for n in (3, 40, 70, 129, 9, 200)]
    fused = PagedEngine(tiny_model.model, num_blocks=96, attention="fused")
    assert fused.attention.name == "fused-cpu" and fused.pool.attention is not None
    gather = PagedEngine(tiny_model.model, num_blocks=96, attention="gather")
    assert gather.pool.attention is None
    assert _greedy(fused, prompts, 24) == _greedy(gather, prompts, 24)


def test_engine_logits_fused_vs_gather(ext, tiny_model):
    """Forward passes of the tiny model (ragged decode, prefill chunks), op on vs off."""
    from mlxq.worker.engine.kv_cache import BatchRow, BatchView, KVPool, make_layer_caches, probe_kv_shape

    model = tiny_model.model
    attention.install_dispatch(model)
    shape = probe_kv_shape(model)
    pool = KVPool(shape, 40)
    rng = np.random.default_rng(1)
    tables = [list(map(int, rng.permutation(40)[i * 8:(i + 1) * 8])) for i in range(4)]
    lens = [150, 33, 240, 64]
    for table, n in zip(tables, lens):  # fill the cache through the gather path
        view = BatchView([BatchRow(table, 0, n)])
        prompt = mx.array(rng.integers(4, 1000, size=(1, n)).astype(np.int32))
        mx.eval(model(prompt, cache=make_layer_caches(pool, view)))
    passes = [  # (rows, tokens): a ragged decode batch, a prefill chunk, a 2-row chunk
        ([BatchRow(t, n, 1) for t, n in zip(tables, lens)], (4, 1)),
        ([BatchRow(tables[2], 200, 20)], (1, 20)),
        ([BatchRow(tables[0], 100, 3), BatchRow(tables[3], 10, 3)], (2, 3)),
    ]
    for rows, shape in passes:
        toks = mx.array(rng.integers(4, 1000, size=shape).astype(np.int32))
        outs = {}
        for name, op in (("gather", None), ("fused", ext.paged_attention)):
            pool.attention = op
            outs[name] = model(toks, cache=make_layer_caches(pool, BatchView(rows)))
            mx.eval(outs[name])
        scale = mx.max(mx.abs(outs["gather"])).item()
        assert mx.max(mx.abs(outs["fused"] - outs["gather"])).item() / scale <= 1e-5, shape


# ------------------------------------------------------------------ models the dispatch can't serve
class _TwistedModel(nn.Module):
    """One attention layer that rescales the keys its cache returned before SDPA: the fused
    op (which reads the pool) cannot follow, so the engine must keep the gather path."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.layers = [nn.Linear(32, 96)]
        self.out = nn.Linear(32, 64)

    def __call__(self, x, cache=None):
        h = self.embed(x)
        B, L, _ = h.shape
        q, k, v = mx.split(self.layers[0](h).reshape(B, L, 3, 2, 16).transpose(2, 0, 3, 1, 4), 3)
        mask = create_attention_mask(h, cache[0])
        k, v = cache[0].update_and_fetch(k[0], v[0])
        o = scaled_dot_product_attention(q[0], k * 2.0, v, cache=cache[0], scale=0.25, mask=mask)
        return self.out(o.transpose(0, 2, 1, 3).reshape(B, L, 32))


def test_model_that_transforms_cached_keys_keeps_gather(ext):
    from mlxq.worker.engine.kv_cache import KVPool, probe_kv_shape

    model = _TwistedModel()
    pool = KVPool(probe_kv_shape(model), 8)
    assert attention.use_attention(model, pool, "auto").name == "gather"
    assert pool.attention is None
    with pytest.raises(ExtensionUnavailable, match="cached keys"):
        attention.use_attention(model, pool, "fused")
    # and the engine runs it (gather path) like any other model
    eng = PagedEngine(model, num_blocks=16)
    assert eng.attention.name == "gather"
    assert len(_greedy(eng, [[1, 2, 3]], 3)["s0"]) == 3


def test_head_dim_the_op_cannot_take_keeps_gather(ext):
    from mlx_lm.models import llama

    model = llama.Model(llama.ModelArgs(
        model_type="llama", hidden_size=48, num_hidden_layers=1, intermediate_size=64,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=64))  # D = 12
    eng = PagedEngine(model, num_blocks=16)
    assert eng.attention.name == "gather" and "multiples of 8" in eng.attention.reason
    with pytest.raises(ExtensionUnavailable, match="multiples of 8"):
        PagedEngine(model, num_blocks=16, attention="fused")


def test_generic_inner_loop_equals_reference(ext):
    """The baseline-ISA loop (what CPUs without AVX2/FMA run), forced in a fresh process."""
    script = (
        "from mlxq.worker import blas; blas.setup()\n"
        f"import sys; sys.path[:0] = [{str(Path(__file__).parent)!r}, {str(KIT)!r}]\n"  # this folder, the kits
        "from test_paged_attention import _case, _rel_err\n"
        "from mlxq.worker.engine import attention\n"
        "ext = attention.cpu_extension()\n"
        "assert ext.isa() == 'generic' and ext.swiglu_isa() == 'generic', ext.isa()\n"
        "from mlxq.worker.engine.kernels import model_ops\n"
        "assert model_ops.checked_ops(ext)[:3] == ('swiglu', 'rope', 'rms_norm'), model_ops.checked_ops(ext)\n"
        "for seed, (B, Hq, Hkv, n, D, ctx, w) in enumerate([(3, 8, 2, [1, 5, 2], 64, [300, 40, 2000], None),"
        " (2, 8, 8, [9, 1], 128, [100, 33], 20)]):\n"
        "    args, n_new = _case(seed, B, Hq, Hkv, n, D, ctx, window=w)\n"
        "    err = _rel_err(ext.paged_attention(*args), attention.gather_attention(*args), n_new)\n"
        "    assert err <= 1e-5, err\n"
        "print('generic ok')\n")
    _run_fresh(script, "generic ok", MLXQ_ATTN_ISA="generic")


def _run_fresh(script: str, ok: str, **env) -> None:
    """Run ``script`` in a fresh process with ``env`` added; it must print ``ok``."""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, **env), cwd=neutral_cwd())
    assert out.returncode == 0, out.stderr[-3000:]
    assert ok in out.stdout


def test_thread_pool_under_late_workers():
    """More pool threads than cores, calls back to back between BLAS matmuls (whose idle
    thread spins on a core): workers often wake after their call has ended. Every call
    must still return exactly the first call's result (a task's result does not depend on
    the thread that runs it), and none may run a stale call's work."""
    script = (
        "from mlxq.worker import blas; blas.setup()\n"
        f"import sys; sys.path[:0] = [{str(Path(__file__).parent)!r}, {str(KIT)!r}]\n"  # this folder, the kits
        "from test_paged_attention import _case\n"
        "import mlx.core as mx\n"
        "from mlxq.worker.engine import attention\n"
        "ext = attention.cpu_extension()\n"
        "assert ext.num_threads() == 4, ext.num_threads()\n"
        "cases = [_case(s, B, 8, 4, [1] * B, 64, [37 * (i + 1) for i in range(B)])[0]\n"
        "         for s, B in enumerate((1, 3, 16))]\n"
        "want = [ext.paged_attention(*a) for a in cases]\n"
        "mx.eval(want)\n"
        "w, x = mx.random.normal((256, 256)), mx.random.normal((16, 256))\n"
        "for it in range(300):\n"
        "    a = cases[it % 3]\n"
        "    q = a[0] + (x @ w).sum() * 0\n"
        "    got = ext.paged_attention(q, *a[1:])\n"
        "    assert mx.array_equal(got, want[it % 3]).item(), it\n"
        "print('pool ok')\n")
    _run_fresh(script, "pool ok", MLXQ_ATTN_THREADS="4")


def _tiles_case():
    """Rows whose queries the op tiles together (a row's query heads, forked rows on shared
    blocks, a prefill chunk's tokens), ragged lengths, a window: (args, quant) per pool kind."""
    cases = []
    for seed, (pool, G, n, window) in enumerate([("float32", 2, 1, None), ("float32", 7, 9, None),
                                                   ("float16", 3, 5, 40), ("q8", 4, 1, None), ("q4", 5, 3, None)]):
        rng = np.random.default_rng(100 + seed)
        Hkv, D, num_blocks = 2, 64, 120
        k, v, quant = _pools(rng, pool, Hkv, D, num_blocks)
        rows = [list(range(20)) + [30 + i] for i in range(6)] + [list(range(60, 75))]
        lens = [640 + 3 * i for i in range(6)] + [470]
        nb = max(len(r) for r in rows)
        tables = mx.array([r + [-1] * (nb - len(r)) for r in rows], dtype=mx.int32)
        q = mx.array(rng.standard_normal((len(rows), G * Hkv, n, D), dtype=np.float32))
        args = (q, k, v, tables, mx.array([c - n for c in lens], dtype=mx.int32), mx.array(lens, dtype=mx.int32),
                D ** -0.5, window)
        cases.append((args, quant))
    return cases


def test_every_isa_of_the_attention_loop_gives_the_same_bits(ext, tmp_path):
    """The AVX-512VL build tiles 4 queries, and a float pool's heads in pairs, 4 pairs a tile, in
    16-lane registers (G = 2: whole tiles of forked rows; G = 7: 3 pairs and a head alone; G = 3 on
    a float16 pool, with a window); the AVX2 build tiles 3, the baseline loop 1: each query's
    arithmetic is the same in any tile, so a fresh process forced onto AVX2 computes the very same
    outputs (rows alone against rows together: test_rows_that_share_blocks_get_their_bits_alone)."""
    if ext.isa() != "avx512vl":
        pytest.skip("this CPU has no AVX-512VL: only one tile width runs here")
    here = [ext.paged_attention(*args, **quant) for args, quant in _tiles_case()]
    script = (
        "from mlxq.worker import blas; blas.setup()\n"
        f"import sys; sys.path[:0] = [{str(Path(__file__).parent)!r}, {str(KIT)!r}]\n"  # this folder, the kits
        "from test_paged_attention import _tiles_case\n"
        "import mlx.core as mx\n"
        "from mlxq.worker.engine import attention\n"
        "ext = attention.cpu_extension()\n"
        "assert ext.isa() == 'avx2', ext.isa()\n"
        "outs = [ext.paged_attention(*a, **q).astype(mx.float32) for a, q in _tiles_case()]\n"
        f"mx.savez({str(tmp_path / 'avx2.npz')!r}, *outs)\n"
        "print('avx2 ok')\n")
    _run_fresh(script, "avx2 ok", MLXQ_ATTN_ISA="avx2")
    there = mx.load(str(tmp_path / "avx2.npz"))
    for i, got in enumerate(here):
        assert mx.array_equal(got.astype(mx.float32), there[f"arr_{i}"]).item(), i
