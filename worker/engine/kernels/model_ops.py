"""Stand-ins for MLX ops inside the stock mlx-lm model files, from the CPU extension.

The x86-64 mlx wheel computes elementwise math one float at a time, and MLX's CPU RoPE and
RMSNorm are graphs of many such ops.  ``swiglu`` (the model modules' name replaced, as
``attention.install_dispatch`` does), ``rope`` (:class:`FastRoPE`) and ``rms_norm``
(:class:`FastRMSNorm`) compute exactly what MLX computes (its own exp and sincos, its operation
order, fma only where MLX has one), so greedy equality with mlx-lm holds bit for bit; each is
checked against MLX when the extension loads (:func:`checked_ops`), and one that differs is not
installed.  Anything but float32 on the CPU keeps MLX's own.

``linear`` (:class:`FastLinear`, a tied head's :class:`FastEmbedding`, sibling projections as
one :class:`LinearGroup`) is not bit-identical to MLX's matmul, but gives a row the same bits in
any batch; it is checked against an error bound (:func:`_check_linear`) and used as the
``matmul`` setting says (``attention.resolve_matmul``).  Why, and what each op saves:
docs/design/attention.md.

``quantized_linear`` (:class:`FastQuantizedLinear`, :class:`FastQuantizedEmbedding`) multiplies by
4- and 8-bit weights as stored, for a model loaded with ``cpu_weights=quantized``: bit for bit
``linear`` on the weights MLX's dequantize gives (the ``cpu_weights=fp32`` model's), where ``linear``
runs its own loops; used with ``linear`` (the same ``matmul`` setting) and checked as it is
(:func:`_check_quantized_linear`).  A model loaded with ``cpu_weights=int8-dot`` marks its packed
layers (:func:`int8_dot`) for the op's integer dot products on x rounded to 8 bits (``csrc/qdot.h``):
checked against that rounding's bound, and a row's bits the same in any batch.
docs/design/quantized-weights.md.
"""

from __future__ import annotations

import logging
import sys
from typing import Callable, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.activations import swiglu as mlx_swiglu

from ...model import INT8_DOT_ATTR, packed_for_extension

log = logging.getLogger(__name__)

OPS = ("swiglu", "rope", "rms_norm", "linear", "quantized_linear")


# ============================================================== checks
class OpMismatch(RuntimeError):
    pass


def check_kv_write(ext) -> None:
    """The in-place KV write against MLX's scatter (the engine relies on it: mandatory)."""
    from .extbuild import ExtensionUnavailable

    rs = mx.random.split(mx.random.key(11), 4)
    k_pool = mx.random.normal((2, 128, 16), key=rs[0])
    v_pool = mx.random.normal((2, 128, 8), key=rs[1])
    keys = mx.random.normal((3, 2, 2, 16), key=rs[2])
    values = mx.random.normal((3, 2, 2, 8), key=rs[3])
    slots = mx.array([5, 6, 40, 41, 127, 0], dtype=mx.int32)
    want_k, want_v = mx.array(k_pool), mx.array(v_pool)
    want_k[:, slots] = keys.transpose(1, 0, 2, 3).reshape(2, 6, 16)
    want_v[:, slots] = values.transpose(1, 0, 2, 3).reshape(2, 6, 8)
    got_k, got_v = ext.paged_kv_write(k_pool, v_pool, keys, values, slots)
    if not (mx.array_equal(got_k, want_k).item() and mx.array_equal(got_v, want_v).item()):
        raise ExtensionUnavailable("the extension's KV write differs from MLX's scatter")


def check_kv_quantize(ext) -> bool:
    """The extension's ``kv_quantize`` against ``KVQuant.quantize``'s MLX ops, bit for bit (both
    widths and every group size, strided rows, a group of one value); False (logged): the pool
    keeps the MLX ops. Either way the blocks are the same bits."""
    from ..kv_cache import KVQuant

    rs = mx.random.split(mx.random.key(16), 3)
    cases = [mx.random.normal((2, 3, 5, 128), key=rs[0]) * 3,
             mx.random.normal((2, 128, 4, 3), key=rs[1]).transpose(0, 2, 3, 1),  # strided rows
             (mx.random.normal((1, 2, 7, 128), key=rs[2]) ** 3) * mx.array([0.0] * 64 + [1.0] * 64)]
    try:
        for bits in (8, 4):
            for g in (32, 64, 128):
                q = KVQuant(bits, g)
                for x in cases:
                    got, want = q.quantize(x, mx.float32, ext.kv_quantize), q.quantize(x, mx.float32)
                    if not all(mx.array_equal(a, b).item() for a, b in zip(got, want)):
                        raise OpMismatch(f"kv_quantize ({bits} bits, group {g}) is not bit-identical to "
                                         "KVQuant.quantize's MLX ops")
    except Exception as e:  # noqa: BLE001 - a mismatch or a broken op: keep the MLX ops
        log.warning("CPU extension: %s; quantized KV blocks keep the MLX ops", e)
        return False
    return True


def _check_swiglu(ext) -> None:
    rs = mx.random.split(mx.random.key(12), 2)
    gate = mx.concatenate([mx.random.normal((997,), key=rs[0]) * 30,
                           mx.array([0.0, -0.0, 88.5, -88.5, 1e-40, float("inf"), -float("inf")])])
    up = mx.random.normal(gate.shape, key=rs[1])
    if not mx.array_equal(ext.swiglu(gate, up), mlx_swiglu(gate, up), equal_nan=True).item():
        raise OpMismatch("swiglu is not bit-identical to mlx-lm's")


def _check_rope(ext) -> None:
    x = mx.random.normal((3, 4, 5, 64), key=mx.random.key(13)) * 3
    cases = [(64, False, 10000.0, 1.0, mx.array(7, dtype=mx.int32)),
             (64, False, 500000.0, 0.5, mx.array([0, 4096, 123457], dtype=mx.int32)),
             (32, True, 10000.0, 1.0, mx.array([9000001, 3, 40], dtype=mx.int32))]
    view = x.transpose(0, 2, 1, 3)  # as the model's queries and keys come: read through their strides
    for y, (dims, trad, base, scale, off) in [(x, c) for c in cases] + [(view, cases[0])]:
        want = mx.fast.rope(y, dims, traditional=trad, base=base, scale=scale, offset=off)
        if not mx.array_equal(ext.rope(y, dims, trad, base, scale, off), want).item():
            raise OpMismatch(f"rope (dims {dims}, traditional {trad}) is not bit-identical to MLX's")


def _check_rms_norm(ext) -> None:
    rs = mx.random.split(mx.random.key(14), 3)
    w = mx.random.normal((96,), key=rs[0])
    for x in (mx.random.normal((3, 2, 96), key=rs[1]) * 40,
              mx.random.normal((2, 96, 5), key=rs[2]).transpose(0, 2, 1),  # strided rows
              mx.zeros((1, 96))):
        for eps in (1e-5, 1e-6):
            if not mx.array_equal(ext.rms_norm(x, w, eps), mx.fast.rms_norm(x, w, eps)).item():
                raise OpMismatch("rms_norm is not bit-identical to MLX's")


def blas_addresses() -> Optional[tuple]:
    """(cblas_sgemm, cblas_sgemv, openblas_set_num_threads, openblas_get_num_threads) in the
    BLAS that :mod:`mlxq.worker.blas` loaded ahead of MLX (the thread calls 0 where the library
    has none), or None: MLX's bundled reference BLAS, nothing to gain."""
    import ctypes

    from ... import blas

    st = blas.status()
    if st is None or not st.active or not st.library:
        return None
    try:
        lib = ctypes.CDLL(st.library)
        addr = lambda name: ctypes.cast(getattr(lib, name), ctypes.c_void_p).value  # noqa: E731
        gemm, gemv = addr("cblas_sgemm"), addr("cblas_sgemv")
    except (OSError, AttributeError):
        return None
    threads = []
    for name in ("openblas_set_num_threads", "openblas_get_num_threads"):
        try:
            threads.append(addr(name))
        except AttributeError:
            threads.append(0)
    return (gemm, gemv, *threads)


def _check_linear(ext) -> None:
    """linear against MLX's matmul within float32 rounding (:func:`within_float32_rounding`): one
    row and several, with and without bias, a strided input and a transposed weight."""
    addrs = blas_addresses()
    if addrs is None:
        raise OpMismatch("linear needs the optimized BLAS mlxq loads ahead of MLX (not loaded here)")
    ext.set_blas(*addrs)
    rs = mx.random.split(mx.random.key(15), 6)
    w = mx.random.normal((300, 517), key=rs[0])
    b = mx.random.normal((300,), key=rs[1])
    wt = mx.random.normal((517, 300), key=rs[5]).T  # columns contiguous
    cases = [(mx.random.normal((1, 1, 517), key=rs[2]), w, None),
             (mx.random.normal((1, 517), key=rs[3]) * 50, w, b),
             (mx.random.normal((517, 3), key=rs[4])[:, 1:2].T, w, b),  # a strided row
             (mx.random.normal((1, 517), key=rs[3]), wt, None),
             (mx.random.normal((2, 37, 517), key=rs[2]), w, b),
             (mx.random.normal((517, 5), key=rs[4]).T, wt, None)]  # strided rows
    for x, wm, bias in cases:
        if not within_float32_rounding(ext.linear(x, wm, bias), x, wm, bias):
            raise OpMismatch("linear differs from MLX's matmul by more than float32 rounding")


def _check_quantized_linear(ext) -> None:
    """quantized_linear against x @ dequantize(w)^T within float32 rounding, 4 and 8 bits, groups of
    32 and 64, at 1 and 5 rows; where linear runs its own loops, bit for bit linear() on the
    dequantized weights (so cpu_weights=quantized computes what cpu_weights=fp32 does); and each row
    of a batch bit for bit its solo call."""
    rs = mx.random.split(mx.random.key(17), 2)
    w = mx.random.normal((75, 256), key=rs[0])
    x = mx.random.normal((5, 256), key=rs[1])
    exact = blas_addresses() is not None and ext.linear_isa() != "blas"  # linear's own loops (set_blas: _check_linear)
    for bits in (4, 8):
        for group in (32, 64):
            wq, scales, biases = mx.quantize(w, group_size=group, bits=bits)
            scales, biases = scales.astype(mx.float32), biases.astype(mx.float32)
            wd = mx.dequantize(wq, scales, biases, group_size=group, bits=bits)
            for rows in (x[:1], x):
                got = ext.quantized_linear(rows, wq, scales, biases, group, bits)
                if not within_float32_rounding(got, rows, wd):
                    raise OpMismatch(f"quantized_linear ({bits} bits, group {group}) differs from x @ dequantize(w).T "
                                     "by more than float32 rounding")
                if exact and not mx.array_equal(got, ext.linear(rows, wd, None)).item():
                    raise OpMismatch(f"quantized_linear ({bits} bits, group {group}) is not bit for bit linear on "
                                     "the dequantized weights")
            solo = mx.concatenate([ext.quantized_linear(x[i:i + 1], wq, scales, biases, group, bits)
                                   for i in range(x.shape[0])])
            if not mx.array_equal(solo, got).item():
                raise OpMismatch("quantized_linear gives a row other bits in a batch than alone")
            # int8_dot: within its rounding of x, and a row's bits alone as in the batch
            got = ext.quantized_linear(x, wq, scales, biases, group, bits, int8_dot=True)
            if not within_int8_rounding(got, x, wd):
                raise OpMismatch(f"quantized_linear's int8_dot ({bits} bits, group {group}) differs from "
                                 "x @ dequantize(w).T by more than x's rounding to 8 bits")
            solo = mx.concatenate([ext.quantized_linear(x[i:i + 1], wq, scales, biases, group, bits, int8_dot=True)
                                   for i in range(x.shape[0])])
            if not mx.array_equal(solo, got).item():
                raise OpMismatch("quantized_linear's int8_dot gives a row other bits in a batch than alone")


def within_int8_rounding(got, x, w) -> bool:
    """``got`` is ``x @ w.T`` with each block of 32 of x's rows rounded to 8 bits (step d = max|x| / 127,
    so each element moved by at most d / 2), up to float32 rounding: |got - MLX's| <= |w| @ (d / 2) +
    2 K 2^-24 (|x| @ |w|^T) elementwise (the float32 term doubled again for the rounded x's own sums)."""
    K = x.shape[-1]
    xb = x.reshape(*x.shape[:-1], K // 32, 32)
    half_step = mx.broadcast_to(mx.max(mx.abs(xb), axis=-1, keepdims=True) / 254, xb.shape).reshape(x.shape)
    bound = half_step @ mx.abs(w).T + 4 * K * 2.0 ** -24 * (mx.abs(x) @ mx.abs(w).T)
    return got.shape[:-1] == x.shape[:-1] and mx.all(mx.abs(got - x @ w.T) <= bound * 1.0001 + 1e-30).item()


def within_float32_rounding(got, x, w, bias=None) -> bool:
    """``got`` is ``x @ w.T (+ bias)`` up to float32 rounding in any summation order:
    |got - MLX's| <= 2 K 2^-24 (|x| @ |w|^T + |bias|) elementwise (the bound of a length-K
    float32 dot product, doubled for the two orders), and the same shape."""
    want = x @ w.T if bias is None else mx.addmm(bias, x, w.T)
    bound = 2 * x.shape[-1] * 2.0 ** -24 * (mx.abs(x) @ mx.abs(w).T + (0 if bias is None else mx.abs(bias)))
    return got.shape == want.shape and mx.all(mx.abs(got - want) <= bound + 1e-30).item()


_checked: Optional[tuple] = None


def checked_ops(ext) -> tuple:
    """The names of the model ops that match MLX bit for bit here (checked once)."""
    global _checked
    if _checked is None:
        ok = []
        for name, check in (("swiglu", _check_swiglu), ("rope", _check_rope), ("rms_norm", _check_rms_norm),
                            ("linear", _check_linear), ("quantized_linear", _check_quantized_linear)):
            try:
                check(ext)
                ok.append(name)
            except Exception as e:  # noqa: BLE001 - a mismatch or a broken op: keep MLX's own
                log.warning("CPU extension: %s; the model keeps MLX's own %s", e, name)
        _checked = tuple(ok)
    return _checked


_kv_quantize_ok: Optional[bool] = None


def checked_kv_quantize(ext) -> bool:
    """:func:`check_kv_quantize`, once a process."""
    global _kv_quantize_ok
    if _kv_quantize_ok is None:
        _kv_quantize_ok = check_kv_quantize(ext)
    return _kv_quantize_ok


def describe(ext, ops: tuple) -> str:
    parts = [f"swiglu {ext.swiglu_isa()}" if "swiglu" in ops else "mlx-lm's swiglu",
             "rope" if "rope" in ops else "MLX's rope",
             "rms_norm" if "rms_norm" in ops else "MLX's rms_norm",
             "linear on the pool" if "linear" in ops else "MLX's matmul",
             f"quantized_linear {ext.qlinear_isa()} (int8_dot {ext.qdot_isa()})" if "quantized_linear" in ops
             else "MLX's quantized_matmul"]
    return "; ".join(parts)


# ============================================================== installing
_installs = 0  # install_* calls so far (a model's ops may have changed since a caller looked)


def installs() -> int:
    """How many times ops were installed into a model (decode_forward re-checks when it moves)."""
    return _installs


def _installed() -> None:
    global _installs
    _installs += 1


def replace_module_global(model, name: str, original, replacement) -> list[str]:
    """In the modules whose classes make up ``model``, point the global ``name`` at
    ``replacement`` where it is ``original``; returns the modules that now use it."""
    names = []
    for m in [model, *[x for _, x in model.named_modules()]]:
        mod = sys.modules.get(type(m).__module__)
        current = None if mod is None else mod.__dict__.get(name)
        if current is original:
            setattr(mod, name, replacement)
        if current is original or current is replacement:
            names.append(mod.__name__)
    return sorted(set(names))


# ============================================================== swiglu
_fast_swiglu: Optional[Callable] = None


def swiglu_dispatch(gate, x):
    """Stands in for mlx_lm.models.activations.swiglu in model modules: the extension's
    for float32 on the CPU, mlx-lm's own otherwise."""
    op = _fast_swiglu
    if (op is not None and gate.dtype == mx.float32 and x.dtype == mx.float32
            and gate.shape == x.shape and mx.default_device() == mx.cpu):
        return op(gate, x)
    return mlx_swiglu(gate, x)


def install_swiglu(model, op: Callable) -> list[str]:
    """Point the loaded model's modules that call mlx-lm's swiglu at swiglu_dispatch."""
    global _fast_swiglu
    _installed()
    _fast_swiglu = op
    return replace_module_global(model, "swiglu", mlx_swiglu, swiglu_dispatch)


# ============================================================== rope
_fast_rope: Optional[Callable] = None


class FastRoPE(nn.RoPE):
    """nn.RoPE with the extension's op for float32 (B, H, T, D) on the CPU."""

    def __call__(self, x, offset: int = 0):
        op = _fast_rope
        if op is not None and x.dtype == mx.float32 and x.ndim == 4 and mx.default_device() == mx.cpu:
            if isinstance(offset, int):
                offset = mx.array(offset, dtype=mx.int32)
            if offset.size in (1, x.shape[0]) and mx.issubdtype(offset.dtype, mx.integer):
                return op(x, self.dims, self.traditional, self.base, self.scale, offset)
        return super().__call__(x, offset)


def install_rope(model, op: Callable) -> int:
    """Make the model's plain nn.RoPE instances FastRoPE; returns how many."""
    global _fast_rope
    _installed()
    _fast_rope = op
    return _swap_class(model, nn.RoPE, FastRoPE)


def _swap_class(model, plain: type, fast: type) -> int:
    """Instances of exactly ``plain`` in ``model`` become ``fast`` (a subclass with the same
    attributes); returns how many ``fast`` ones it has."""
    n = 0
    for _, m in model.named_modules():
        if type(m) is plain:
            m.__class__ = fast
        if type(m) is fast:
            n += 1
    return n


# ============================================================== rms_norm
_fast_rms_norm: Optional[Callable] = None


class FastRMSNorm(nn.RMSNorm):
    """nn.RMSNorm with the extension's op for float32 on the CPU."""

    def __call__(self, x):
        op = _fast_rms_norm
        w = self["weight"]
        if op is not None and x.dtype == mx.float32 and w.dtype == mx.float32 and mx.default_device() == mx.cpu:
            return op(x, w, self.eps)
        return super().__call__(x)


def install_rms_norm(model, op: Callable) -> int:
    """Make the model's plain nn.RMSNorm instances FastRMSNorm; returns how many."""
    global _fast_rms_norm
    _installed()
    _fast_rms_norm = op
    return _swap_class(model, nn.RMSNorm, FastRMSNorm)


# ============================================================== linear
def _takes(x, w) -> bool:
    return x.dtype == mx.float32 and w.dtype == mx.float32 and x.ndim >= 1 and mx.default_device() == mx.cpu


class FastLinear(nn.Linear):
    """nn.Linear with the extension's linear for float32 on the CPU (the op is the instance's
    ``_mlxq_linear``, set by :func:`install_linear`; None: MLX's matmul). A member of a
    :class:`LinearGroup` (``_mlxq_group``) takes its output from the group's one call when it can."""

    def __call__(self, x):
        op = getattr(self, "_mlxq_linear", None)
        w = self["weight"]
        if op is not None and _takes(x, w):
            member = getattr(self, "_mlxq_group", None)
            if member is not None:
                out = member[0].output(member[1], x)
                if out is not None:
                    return out
            return op(x, w, self["bias"] if "bias" in self else None)
        return super().__call__(x)


# Sibling projections a model applies to the same x, one right after the other (mlx-lm's
# attention: q, k, v; its MLP: gate, up).
GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class LinearGroup:
    """FastLinear layers a model applies to the same x one after the other: the first member's
    call computes every member's output in one call of the extension's ``linear_group`` (one
    primitive, one pass of the pool; each output bit for bit the member's own ``linear``), and
    the others take theirs when they get the very same x, in order; otherwise each computes
    alone."""

    def __init__(self, members: list, op: Callable):
        self.members, self.op = members, op
        self._pending = None  # (x, outputs): after the first member's call, until the last's

    def output(self, i: int, x) -> Optional[mx.array]:
        if i == 0:
            self._pending = None
            ws = [m["weight"] for m in self.members]
            if any(w.dtype != mx.float32 or w.ndim != 2 or w.shape[1] != x.shape[-1] for w in ws):
                return None
            biases = [m["bias"] for m in self.members if "bias" in m]
            if biases and len(biases) != len(ws):
                return None
            outs = self.op(x, ws, biases)
            self._pending = (x, outs)
            return outs[0]
        pending = self._pending
        if pending is None or pending[0] is not x:
            return None
        if i == len(self.members) - 1:
            self._pending = None
        return pending[1][i]


def sibling_groups(model, kind: type = nn.Linear):
    """The sibling projections of :data:`GROUPS` in ``model``: each as the list of its modules,
    where every member is a ``kind``."""
    for _, m in model.named_modules():
        for names in GROUPS:
            members = [getattr(m, name, None) for name in names]
            if all(isinstance(x, kind) for x in members):
                yield members


def install_groups(model, group_op: Optional[Callable]) -> int:
    """Group the FastLinear siblings of :data:`GROUPS` (None: ungroup them); returns how many groups."""
    _installed()
    n = 0
    for members in sibling_groups(model, FastLinear):
        group = LinearGroup(members, group_op) if group_op is not None else None
        for i, x in enumerate(members):
            object.__setattr__(x, "_mlxq_group", (group, i) if group is not None else None)
        n += group is not None
    return n


class FastEmbedding(nn.Embedding):
    """nn.Embedding whose ``as_linear`` (a tied vocabulary head) takes the same path."""

    def as_linear(self, x):
        op = getattr(self, "_mlxq_linear", None)
        w = self["weight"]
        if op is not None and _takes(x, w):
            return op(x, w, None)
        return super().as_linear(x)


def _install_op(model, embedding: tuple, linear: tuple, attr: str, op: Optional[Callable]) -> int:
    """Make the model's plain embedding and linear layers (each pair: (fast class, plain class)) the
    fast ones, with ``attr`` set to ``op`` (None: MLX's own); returns how many linear layers call ``op``."""
    _installed()
    n = 0
    for fast, plain in (embedding, linear):
        if op is not None:
            _swap_class(model, plain, fast)
        for _, m in model.named_modules():
            if type(m) is fast:
                object.__setattr__(m, attr, op)
                n += fast is linear[0] and op is not None
    return n


def install_linear(model, op: Optional[Callable]) -> int:
    """Make the model's plain nn.Linear and nn.Embedding instances FastLinear and FastEmbedding
    calling ``op`` (None: MLX's own matmul); returns how many Linear layers call ``op``."""
    return _install_op(model, (FastEmbedding, nn.Embedding), (FastLinear, nn.Linear), "_mlxq_linear", op)


# ============================================================== quantized linear
def quantized_layer_fits(m) -> bool:
    """Whether the extension's quantized_linear takes layer ``m``'s weights: MLX's affine 4- or 8-bit
    blocks in groups of 32, 64 or 128, with float32 scales and biases (with int8_dot also float16 or
    bfloat16 ones, both of one type: worker/model.py's narrow_scales)."""
    if not packed_for_extension(m):
        return False
    return m["scales"].dtype == mx.float32 or (int8_dot(m) and m["scales"].dtype in (mx.float16, mx.bfloat16))


def _qtakes(x, m) -> bool:
    """Whether the extension's quantized_linear computes ``m`` (a quantized layer) on ``x``: float32
    on the CPU, and weights it takes."""
    return x.dtype == mx.float32 and x.ndim >= 1 and mx.default_device() == mx.cpu and quantized_layer_fits(m)


def int8_dot(m) -> bool:
    """Whether packed layer ``m`` runs quantized_linear's integer dot products (cpu_weights=int8-dot)."""
    return getattr(m, INT8_DOT_ATTR, False)


def _qlinear(m, x):
    """The extension's quantized_linear of layer ``m`` on ``x``, or None where it does not apply."""
    op = getattr(m, "_mlxq_qlinear", None)
    if op is None or not _qtakes(x, m):
        return None
    return op(x, m["weight"], m["scales"], m["biases"], m.group_size, m.bits, int8_dot=int8_dot(m))


def _narrowed(m) -> bool:
    """Whether int8_dot keeps packed layer ``m``'s scales and biases in 16 bits (worker/model.py's
    narrow_scales). MLX's quantized_matmul computes on them what it does on their float32s; its
    dequantize would give rows of their type, so the embedding's lookup widens them first (exact)."""
    return int8_dot(m) and m["scales"].dtype in (mx.float16, mx.bfloat16)


class FastQuantizedLinear(nn.QuantizedLinear):
    """nn.QuantizedLinear with the extension's quantized_linear (``_mlxq_qlinear``, set by
    :func:`install_quantized_linear`; None: MLX's quantized_matmul) where :func:`_qtakes`."""

    def __call__(self, x):
        y = _qlinear(self, x)
        if y is None:
            return super().__call__(x)
        return y + self["bias"] if "bias" in self else y


class FastQuantizedEmbedding(nn.QuantizedEmbedding):
    """nn.QuantizedEmbedding whose ``as_linear`` (a tied vocabulary head) takes the same path; with
    16-bit scales (:func:`_narrowed`) its lookup dequantizes the rows it takes from them widened."""

    def __call__(self, x):
        if not _narrowed(self):
            return super().__call__(x)
        return mx.dequantize(self["weight"][x], scales=self["scales"][x].astype(mx.float32),
                             biases=self["biases"][x].astype(mx.float32), group_size=self.group_size,
                             bits=self.bits, mode=self.mode)

    def as_linear(self, x):
        y = _qlinear(self, x)
        return super().as_linear(x) if y is None else y


def install_quantized_linear(model, op: Optional[Callable]) -> int:
    """Make the model's plain quantized layers the Fast ones calling ``op`` (None: MLX's own);
    returns how many quantized Linear layers call ``op``."""
    return _install_op(model, (FastQuantizedEmbedding, nn.QuantizedEmbedding),
                       (FastQuantizedLinear, nn.QuantizedLinear), "_mlxq_qlinear", op)


def install(model, ext, ops: tuple) -> None:
    if "swiglu" in ops:
        install_swiglu(model, ext.swiglu)
    if "rope" in ops:
        install_rope(model, ext.rope)
    if "rms_norm" in ops:
        install_rms_norm(model, ext.rms_norm)
    install_linear(model, ext.linear if "linear" in ops else None)
    install_groups(model, ext.linear_group if "linear" in ops else None)
    install_quantized_linear(model, ext.quantized_linear if "quantized_linear" in ops else None)
