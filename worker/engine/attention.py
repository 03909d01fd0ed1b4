"""Attention that reads KV blocks where they lie in the pool.

The op (one interface, three implementations)::

    paged_attention(queries (B, Hq, N, D), k_pool (Hkv, S, Dk), v_pool (Hkv, S, Dv),
                    block_tables (B, nb) int32, q_offsets (B,) int32, kv_lens (B,) int32,
                    scale, window=None, *, k_scales=None, k_biases=None, v_scales=None,
                    v_biases=None, bits=0, group_size=0) -> (B, Hq, N, Dv)

S = num_blocks * 32. Query i of row b sits at position q_offsets[b] + i and attends the keys
j <= q_offsets[b] + i, j < kv_lens[b] and, given a window, j > pos - window; key j of row b is
pool row block_tables[b][j // 32] * 32 + j % 32. Query head h reads KV head h // (Hq // Hkv).
Queries that see no key (padding) are don't-care. Quantized pools (``bits`` 4 or 8) hold
``mx.quantize``'s packed uint32 rows with their scales/biases; every implementation dequantizes
what it reads.

``gather_attention`` (plain MLX ops) is the reference and the fallback; the CPU extension
(``csrc/``, built on first use by :mod:`.extbuild`) is the fused op; ``metal_paged_attention``
has never run (no Metal GPU here): only ``--attention fused`` on a GPU selects it.  The stock
model files reach it through :func:`use_attention`; how, and what it saves:
docs/design/attention.md.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Callable, Optional

import mlx.core as mx
import mlx.nn as nn
import mlx_lm.models.base as mlx_base
from mlx_lm.models.cache import make_prompt_cache

from ...shared.settings import ATTENTION_MODES, MATMUL_MODES

from .block_manager import BLOCK_SIZE
from .kernels import model_ops
from .kernels.extbuild import ExtensionUnavailable
from .kv_cache import KVPool, PagedLayerCache, _ShapeProbe

log = logging.getLogger(__name__)

MODES = ATTENTION_MODES  # the attention setting (MLXQ_ATTENTION / --attention) is read by Settings


# ============================================================== the reference
def _gather_blocks(pool_arr, block_tables, block_size: int) -> mx.array:
    """(Hkv, S, W) pool rows -> (B, Hkv, nb * block_size, W) in block-table order."""
    Hkv, _, W = pool_arr.shape
    B, nb = block_tables.shape
    heads = mx.arange(Hkv)[None, :, None]
    g = pool_arr.reshape(Hkv, -1, block_size, W)[heads, block_tables[:, None, :]]
    return g.reshape(B, Hkv, nb * block_size, W)


def _gather_side(pool_arr, scales, biases, block_tables, bits: int, group_size: int,
                 block_size: int) -> mx.array:
    """One side's gathered rows, dequantized when ``bits`` is set."""
    rows = _gather_blocks(pool_arr, block_tables, block_size)
    if not bits:
        return rows
    return mx.dequantize(rows, _gather_blocks(scales, block_tables, block_size),
                         _gather_blocks(biases, block_tables, block_size), group_size=group_size, bits=bits)


def gather_attention(queries, k_pool, v_pool, block_tables, q_offsets, kv_lens, scale: float,
                     window: Optional[int] = None, block_size: int = BLOCK_SIZE, *, k_scales=None,
                     k_biases=None, v_scales=None, v_biases=None, bits: int = 0,
                     group_size: int = 0) -> mx.array:
    """The op in plain MLX ops: gather each row's blocks (dequantized with
    ``mx.dequantize`` for a quantized pool), masked softmax attention (fp32)."""
    B, Hq, N, D = queries.shape
    Hkv = k_pool.shape[0]
    G = Hq // Hkv
    nb = block_tables.shape[1]
    k = _gather_side(k_pool, k_scales, k_biases, block_tables, bits, group_size, block_size)
    v = _gather_side(v_pool, v_scales, v_biases, block_tables, bits, group_size, block_size)
    Dv = v.shape[3]
    q = queries.astype(mx.float32).reshape(B, Hkv, G * N, D) * scale
    scores = q @ k.astype(mx.float32).transpose(0, 1, 3, 2)  # (B, Hkv, G*N, L)
    pos = q_offsets.astype(mx.int32)[:, None] + mx.arange(N, dtype=mx.int32)[None]  # (B, N)
    pos = mx.broadcast_to(pos[:, None, :], (B, G, N)).reshape(B, 1, G * N, 1)
    j = mx.arange(nb * block_size, dtype=mx.int32)[None, None, None]
    visible = (j <= pos) & (j < kv_lens.astype(mx.int32)[:, None, None, None])
    if window:
        visible = visible & (j > pos - window)
    scores = mx.where(visible, scores, -mx.inf)
    probs = mx.softmax(scores, axis=-1, precise=True)
    probs = mx.where(mx.any(visible, axis=-1, keepdims=True), probs, 0.0)  # no key: zeros
    out = probs @ v.astype(mx.float32)
    return out.reshape(B, Hq, N, Dv).astype(queries.dtype)


# ============================================================== Metal (never run here)
_METAL_SOURCE = """
    // One SIMD group (32 threads) per query (b, h, n); lane t holds elements
    // t, t + 32, ... of the query, the accumulator and each K/V row.
    uint qi = threadgroup_position_in_grid.x;
    uint lane = thread_index_in_simdgroup;
    int n = qi % NQ;
    int h = (qi / NQ) % HQ;
    int b = qi / (NQ * HQ);
    int hk = h / (HQ / HKV);
    int pos = q_offsets[b] + n;
    int hi = min(min(pos + 1, kv_lens[b]), NB * BS);
    int lo = WINDOW > 0 ? max(0, pos - WINDOW + 1) : 0;
    float sc = scale[0];
    float q[DK / 32];
    for (int i = 0; i < DK / 32; ++i)
        q[i] = float(queries[((long)(b * HQ + h) * NQ + n) * DK + lane + 32 * i]) * sc;
    float acc[DV / 32];
    for (int i = 0; i < DV / 32; ++i) acc[i] = 0.0f;
    float m = -INFINITY;
    float l = 0.0f;
    for (int j = lo; j < hi; ++j) {
        int blk = block_tables[b * NB + j / BS];
        if (blk < 0 || blk >= NUM_BLOCKS) continue;
        long row = (long)hk * NUM_BLOCKS * BS + (long)blk * BS + (j % BS);
        float s = 0.0f;
        for (int i = 0; i < DK / 32; ++i)
            s += q[i] * @READ(k, DK, lane + 32 * i)@;
        s = simd_sum(s);
        float mnew = max(m, s);
        float corr = exp(m - mnew);
        float p = exp(s - mnew);
        l = l * corr + p;
        for (int i = 0; i < DV / 32; ++i)
            acc[i] = acc[i] * corr + p * @READ(v, DV, lane + 32 * i)@;
        m = mnew;
    }
    float inv = l > 0.0f ? 1.0f / l : 0.0f;
    for (int i = 0; i < DV / 32; ++i)
        out[((long)(b * HQ + h) * NQ + n) * DV + lane + 32 * i] = T(acc[i] * inv);
"""
# A float pool's element e of a row, and a quantized pool's (mx.quantize's layout: element
# e in bits (e * QBITS) % 32 of uint32 word (e * QBITS) / 32, affine per GS-element group).
# Like the rest of the Metal source, the quantized read has never run (no Metal GPU here).
_METAL_READ = {
    False: "float({s}_pool[row * {d} + ({e})])",
    True: ("(float((({s}_pool[row * ({d} * QBITS / 32) + (({e}) * QBITS) / 32]) >> ((({e}) * QBITS) % 32))"
           " & ((1u << QBITS) - 1u)) * float({s}_scales[row * ({d} / GS) + ({e}) / GS])"
           " + float({s}_biases[row * ({d} / GS) + ({e}) / GS]))"),
}


def _metal_source(quantized: bool) -> str:
    parts = _METAL_SOURCE.split("@")
    for i in range(1, len(parts), 2):  # READ(side, dim, element)
        side, dim, elem = (x.strip() for x in parts[i][len("READ("):-1].split(",", 2))
        parts[i] = _METAL_READ[quantized].format(s=side, d=dim, e=elem)
    return "".join(parts)


_metal_kernels: dict = {}


def metal_paged_attention(queries, k_pool, v_pool, block_tables, q_offsets, kv_lens,
                          scale: float, window: Optional[int] = None,
                          block_size: int = BLOCK_SIZE, *, k_scales=None, k_biases=None,
                          v_scales=None, v_biases=None, bits: int = 0,
                          group_size: int = 0) -> mx.array:
    """The op as a Metal kernel (``mx.fast.metal_kernel``). NOT RUN on any machine yet.

    Head dims must be multiples of 32. A simple design: one SIMD group per query, so
    GQA groups each read their KV rows (no sharing across the query heads of a group).
    """
    B, Hq, N, D = queries.shape
    Hkv, S, _ = k_pool.shape
    Dv = v_scales.shape[2] * group_size if bits else v_pool.shape[2]
    if D % 32 or Dv % 32:
        raise ValueError("the Metal kernel needs head dims that are multiples of 32")
    quantized = bool(bits)
    if quantized not in _metal_kernels:
        extra = ["k_scales", "k_biases", "v_scales", "v_biases"] if quantized else []
        _metal_kernels[quantized] = mx.fast.metal_kernel(
            name="mlxq_paged_attention" + ("_q" if quantized else ""),
            input_names=["queries", "k_pool", "v_pool", "block_tables", "q_offsets", "kv_lens",
                         "scale"] + extra,
            output_names=["out"],
            source=_metal_source(quantized),
        )
    extra = [k_scales, k_biases, v_scales, v_biases] if quantized else []
    (out,) = _metal_kernels[quantized](
        inputs=[queries, k_pool, v_pool, block_tables.astype(mx.int32),
                q_offsets.astype(mx.int32), kv_lens.astype(mx.int32),
                mx.array([scale], dtype=mx.float32)] + extra,
        template=[("T", queries.dtype), ("NQ", N), ("HQ", Hq), ("HKV", Hkv), ("DK", D),
                  ("DV", Dv), ("NB", block_tables.shape[1]), ("BS", block_size),
                  ("NUM_BLOCKS", S // block_size), ("WINDOW", int(window or 0))]
                 + ([("QBITS", bits), ("GS", group_size)] if quantized else []),
        grid=(32 * B * Hq * N, 1, 1),
        threadgroup=(32, 1, 1),
        output_shapes=[(B, Hq, N, Dv)],
        output_dtypes=[queries.dtype],
    )
    return out


# ============================================================== the CPU extension
_cpu_ext = None
_cpu_error: Optional[str] = None


def cpu_extension(build_if_missing: bool = True):
    """The loaded, checked CPU extension module. Raises ExtensionUnavailable (remembered)."""
    global _cpu_ext, _cpu_error
    if _cpu_ext is not None:
        return _cpu_ext
    if _cpu_error is not None:
        raise ExtensionUnavailable(_cpu_error)
    from .kernels import extbuild

    try:
        ext = extbuild.load(build_if_missing=build_if_missing)
        _self_check(ext.paged_attention)
        model_ops.check_kv_write(ext)
    except ExtensionUnavailable as e:
        if build_if_missing:
            _cpu_error = str(e)
        raise
    except Exception as e:  # noqa: BLE001 - e.g. a nanobind/mlx type mismatch: TypeError
        _cpu_error = f"the extension loaded but failed its self-check: {type(e).__name__}: {e}"
        raise ExtensionUnavailable(_cpu_error) from e
    _cpu_ext = ext
    return ext


def _self_check(op) -> None:
    """One small ragged GQA case against the reference (catches ABI and build mistakes)."""
    rs = mx.random.split(mx.random.key(7), 4)
    k_pool = mx.random.normal((2, 8 * BLOCK_SIZE, 64), key=rs[0])
    v_pool = mx.random.normal((2, 8 * BLOCK_SIZE, 64), key=rs[1])
    q = mx.random.normal((2, 4, 3, 64), key=rs[2])
    tables = mx.array([[3, 1, 6], [0, 5, 2]], dtype=mx.int32)
    q_off = mx.array([70, 5], dtype=mx.int32)
    kv_lens = mx.array([73, 8], dtype=mx.int32)
    args = (q, k_pool, v_pool, tables, q_off, kv_lens, 0.125)
    _check_case(op, args, {}, "")
    for bits in (8, 4):  # the same blocks quantized: the kernel's dequantization
        kq, ks, kb = mx.quantize(k_pool, group_size=32, bits=bits)
        vq, vs, vb = mx.quantize(v_pool, group_size=32, bits=bits)
        quant = dict(k_scales=ks, k_biases=kb, v_scales=vs, v_biases=vb, bits=bits, group_size=32)
        _check_case(op, (q, kq, vq) + args[3:], quant, f" ({bits}-bit blocks)")


def _check_case(op, args, quant: dict, what: str) -> None:
    got = op(*args, 40, **quant)
    want = gather_attention(*args, 40, **quant)
    err = mx.max(mx.abs(got - want)).item()
    if not err <= 1e-4:
        raise ExtensionUnavailable(f"the extension's self-check{what} differs from the reference by {err}")


# ============================================================== choosing a backend
@dataclass(frozen=True)
class AttentionBackend:
    name: str  # "fused-cpu", "fused-metal" or "gather"
    reason: str
    op: Optional[Callable] = None  # the paged op; None for the gather path
    # fused-cpu only: the in-place KV write, and the model ops (swiglu, rope) of the same
    # extension that passed their bit-for-bit check against MLX (model_ops.checked_ops)
    kv_write: Optional[Callable] = None
    model_ops: tuple = ()
    matmul: str = "mlx"  # the weight matmuls use_attention settled on: "pool" or "mlx"

    @property
    def fused(self) -> bool:
        return self.op is not None


def resolve_mode(mode: Optional[str]) -> str:
    mode = (mode or "auto").strip().lower()
    if mode not in MODES:
        raise ValueError(f"attention must be one of {', '.join(MODES)} (got {mode!r})")
    return mode


def select_backend(mode: Optional[str] = None) -> AttentionBackend:
    """auto: the CPU extension when it builds and loads, else the gather path (and why);
    fused: the fused op or an error; gather: the reference path. On a GPU device, auto is
    the gather path (the Metal kernel has not been run) and fused is the Metal kernel."""
    mode = resolve_mode(mode)
    if mode == "gather":
        return AttentionBackend("gather", "asked for")
    if mx.default_device() == mx.gpu:
        if mode == "auto":
            return AttentionBackend(
                "gather", "GPU device: the Metal kernel has never been run, so it is opt-in "
                          "(--attention fused)")
        return AttentionBackend("fused-metal", "asked for (untested Metal kernel)",
                                metal_paged_attention)
    try:
        ext = cpu_extension()
    except ExtensionUnavailable as e:
        if mode == "fused":
            raise
        return AttentionBackend("gather", f"the CPU extension is unavailable: {e}")
    ops = model_ops.checked_ops(ext)
    return AttentionBackend(
        "fused-cpu", f"CPU extension ({ext.isa()}, {ext.num_threads()} threads; in-place KV writes; "
                     f"{model_ops.describe(ext, ops)})",
        ext.paged_attention, kv_write=ext.paged_kv_write, model_ops=ops)


def paged_attention(queries, k_pool, v_pool, block_tables, q_offsets, kv_lens, scale: float,
                    window: Optional[int] = None, **quant) -> mx.array:
    """The op (see the module doc): the CPU extension where it loads, else the Metal kernel
    on a GPU device, else the gather reference. ``quant``: the quantized pool's arguments."""
    if mx.default_device() == mx.gpu:
        op = metal_paged_attention
    else:
        try:
            op = cpu_extension().paged_attention
        except ExtensionUnavailable:
            op = gather_attention
    return op(queries, k_pool, v_pool, block_tables, q_offsets, kv_lens, scale, window, **quant)


# ============================================================== the model dispatch
class _RouteProbe(_ShapeProbe):
    """A probe cache that records whether the layer's attention went through _dispatch
    with the very keys and values the cache handed out (not a transform of them)."""

    routed = False
    handed_out = None

    def update_and_fetch(self, keys, values):
        self.handed_out = (keys, values)
        return super().update_and_fetch(keys, values)


def _untouched(cache, keys, values) -> bool:
    out = cache.handed_out
    return out is not None and keys is out[0] and values is out[1]


def _dispatch(queries, keys, values, cache, scale, mask, sinks=None):
    """Stands in for mlx_lm.models.base.scaled_dot_product_attention in model modules."""
    if isinstance(cache, PagedLayerCache):
        pool = cache.pool
        if pool.attention is not None:
            if not _untouched(cache, keys, values):  # routes_all_layers rules this out
                raise RuntimeError("the model changed the keys/values its paged cache returned; "
                                   "the fused attention cannot follow (use --attention gather)")
            view = cache.view
            window = view.window_of(mask) if sinks is None else NotImplemented
            if window is not NotImplemented:
                return pool.attention(
                    queries, pool.keys[cache.layer], pool.values[cache.layer], view.tables,
                    view.q_offsets, view.kv_lens, scale, window, **pool.quant_kwargs(cache.layer))
            keys, values = cache.gathered()  # update_and_fetch skipped the gather
    elif isinstance(cache, _RouteProbe):
        cache.routed = _untouched(cache, keys, values)
    return mlx_base.scaled_dot_product_attention(
        queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)


def install_dispatch(model) -> list[str]:
    """Point the loaded model's modules at _dispatch; returns their names.  A dispatch, not the
    cache alone: the model calls SDPA itself on what its cache returns, so only the SDPA name it
    calls can change what attention computes (``routes_all_layers`` checks every layer uses it)."""
    return model_ops.replace_module_global(
        model, "scaled_dot_product_attention", mlx_base.scaled_dot_product_attention, _dispatch)


def routes_all_layers(model) -> bool:
    """True when every layer's attention call goes through _dispatch with the keys and
    values its cache returned (one probe pass, graph construction only; nothing is
    evaluated)."""
    probes = [_RouteProbe() for _ in range(len(make_prompt_cache(model)))]
    model(mx.array([[0]]), cache=probes)
    return all(p.routed for p in probes)


def use_attention(model, pool: KVPool, mode: Optional[str] = None, matmul: str = "mlx") -> AttentionBackend:
    """Choose the engine's attention, wire it to the pool and the model, and log it. ``matmul``:
    "pool" installs the extension's ``linear`` (an error where it cannot run), "mlx" keeps MLX's
    own weight matmuls, "auto" is "pool" where the extension runs its own loops (AVX2+FMA), else
    "mlx" (see :func:`resolve_matmul`)."""
    if matmul not in MATMUL_MODES:
        raise ValueError(f"matmul must be one of {', '.join(MATMUL_MODES)} (got {matmul!r})")
    backend = select_backend(mode)
    if backend.fused:
        why = None
        multiple = 32 if backend.name == "fused-metal" else 8
        dims = {d for s in pool.shape.layers for d in (s.k_head_dim, s.v_head_dim)}
        if any(d % multiple for d in dims):
            why = f"head dims {sorted(dims)}: the {backend.name} op needs multiples of {multiple}"
        elif not install_dispatch(model) or not routes_all_layers(model):
            why = ("the model's attention does not call mlx_lm.models.base."
                   "scaled_dot_product_attention on its cached keys/values in every layer")
        if why is not None:
            if resolve_mode(mode) == "fused":
                raise ExtensionUnavailable(why)
            backend = AttentionBackend("gather", why)
    matmul, matmul_why = resolve_matmul(backend, matmul)
    pool.attention = backend.op
    pool.kv_write = backend.kv_write if backend.fused else None
    # quantized blocks: the extension's kv_quantize where it gives KVQuant.quantize's MLX ops' bits
    # (checked once, and only for a quantized pool)
    pool.kv_quantize = None
    if backend.name == "fused-cpu" and pool.quant is not None:
        ext = cpu_extension()
        pool.kv_quantize = ext.kv_quantize if model_ops.checked_kv_quantize(ext) else None
    if backend.fused and backend.model_ops:
        ops = tuple(o for o in backend.model_ops if o not in ("linear", "quantized_linear") or matmul == "pool")
        model_ops.install(model, cpu_extension(), ops)
    else:
        model_ops.install_linear(model, None)  # a model an earlier engine set up keeps MLX's matmul too
        model_ops.install_groups(model, None)
        model_ops.install_quantized_linear(model, None)
    backend = replace(backend, matmul=matmul)
    log.info("attention: %s (%s); weight matmuls: %s (%s)", backend.name, backend.reason, matmul, matmul_why)
    return backend


def batch_dependence(backend: AttentionBackend, model) -> Optional[str]:
    """None where a row's logits are the same bits in any batch shape, at any number of positions a
    row (the weight matmuls run the extension's own loops, ``csrc/rowdot.h``; the fused attention is
    per query), else what can make them follow the batch.  Speculation's default rests on it: a
    verify pass over k + 1 positions then gives the bits of k + 1 one-token steps."""
    if backend.matmul != "pool":
        return f"the weight matmuls are {backend.matmul}'s (MLX's: a row's bits can follow its batch)"
    if cpu_extension().linear_isa() == "blas":
        return "the weight matmuls are the BLAS fallback's (its rounding of a row can follow the batch)"
    if "quantized_linear" not in backend.model_ops and any(
            isinstance(m, nn.QuantizedLinear) for _, m in model.named_modules()):
        return "the model's quantized layers run MLX's quantized matmul (the extension's did not pass its check)"
    return None


def resolve_matmul(backend: AttentionBackend, matmul: str) -> tuple[str, str]:
    """("pool" or "mlx", why) for the asked-for mode on this backend. "pool" needs the CPU
    extension's ``linear`` (checked against MLX when it loaded, over the optimized BLAS); asked
    for where it is missing, it is an error, not a silent fallback. "auto" takes it only where
    the extension runs its own loops (``csrc/rowdot.h``: a row's bits do not depend on its batch),
    not the BLAS fallback (sgemm, whose rounding of a row can follow the batch)."""
    has_linear = backend.fused and "linear" in backend.model_ops
    if matmul == "pool":
        if not has_linear:
            why = (f"the attention is {backend.name} ({backend.reason})" if not backend.fused else
                   "the extension's linear did not pass its check here, or no optimized BLAS is loaded")
            raise ExtensionUnavailable(f"matmul=pool needs the CPU extension's linear: {why}")
        return "pool", f"asked for; {cpu_extension().linear_isa()} loops"
    if matmul == "mlx":
        return "mlx", "asked for"
    if not has_linear:
        return "mlx", "auto: the CPU extension's linear is not in use here"
    isa = cpu_extension().linear_isa()
    if isa == "blas":
        return "mlx", "auto: this CPU lacks AVX2+FMA, and the BLAS fallback's rounding can follow the batch"
    return "pool", f"auto: our own {isa} loops"
