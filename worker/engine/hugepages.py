"""2 MiB pages for the arrays a decode step streams through: the model's weights and the KV pool.

With 4 KiB pages a step touches one page per 4 KiB it reads. Inside a VM every TLB miss is a
two-level walk, and the kernel's transparent huge pages are usually ``madvise`` only, so MLX's
buffers get 4 KiB pages. :func:`advise` asks for 2 MiB pages on each large array's aligned
interior (``MADV_HUGEPAGE``) and collapses it now (``MADV_COLLAPSE``, Linux 6.1+), where the
kernel allows; elsewhere (macOS, older kernels, THP off) it does nothing. Only placement: the
same bytes, the same bits.

The pool keeps its pages: the fused attention's KV writes are in place. An array MLX replaces
(a block copy on the gather path) is back on 4 KiB pages, which costs only speed.

Only an array's 2 MiB-aligned interior can be a huge page, and MLX gives each array its own
allocation: a weight matrix of a few MiB has little or no such interior. :func:`pack` first
copies the model's smaller parameters, in order, into a few large buffers (one per dtype and
~64 MiB), each parameter then a view of its buffer (the same bytes and shape, rows contiguous),
so that all but the buffers' ends get huge pages. What each saves, measured on the bench model:
docs/design/engine.md and docs/benchmark-history.md.
"""

from __future__ import annotations

import ctypes
import logging
import sys
import time
from typing import Iterable, Optional

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

log = logging.getLogger(__name__)

HUGE = 2 << 20
MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25

_madvise = None


def _libc_madvise():
    global _madvise
    if _madvise is None:
        fn = ctypes.CDLL(None, use_errno=True).madvise
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        fn.restype = ctypes.c_int
        _madvise = fn
    return _madvise


def _on_linux_cpu() -> bool:
    return sys.platform.startswith("linux") and mx.default_device() == mx.cpu


def _span(a: mx.array) -> Optional[tuple[int, int]]:
    """The array's data as [start, end) addresses (a zero-copy view of its buffer), or None when
    its buffer is not one contiguous run (a transposed or sliced view)."""
    try:
        buf = np.frombuffer(memoryview(a), dtype=np.uint8)
    except (BufferError, ValueError, TypeError):
        return None
    return buf.ctypes.data, buf.ctypes.data + buf.nbytes


def advise(arrays: Iterable[mx.array]) -> int:
    """Back the 2 MiB-aligned interior of each array with huge pages where the kernel allows;
    returns the bytes asked for (0 where nothing could be: not Linux, small arrays, THP off).
    The arrays must be evaluated; one whose data is not one contiguous run is skipped."""
    if not _on_linux_cpu():
        return 0
    madvise = _libc_madvise()
    t0, asked, collapsed = time.perf_counter(), 0, 0
    for a in arrays:
        if a.nbytes < 2 * HUGE:
            continue
        span = _span(a)
        if span is None:
            continue
        lo, hi = (span[0] + HUGE - 1) // HUGE * HUGE, span[1] // HUGE * HUGE
        if hi <= lo:
            continue
        if madvise(lo, hi - lo, MADV_HUGEPAGE) != 0:
            log.debug("huge pages refused (errno %d): left on 4 KiB pages", ctypes.get_errno())
            return 0
        asked += hi - lo
        if madvise(lo, hi - lo, MADV_COLLAPSE) == 0:
            collapsed += hi - lo
    if asked:
        log.info("huge pages: %.0f MiB asked, %.0f MiB collapsed now, in %.2f s", asked / 2**20,
                 collapsed / 2**20, time.perf_counter() - t0)
    return asked


# Parameters under this size are packed (a larger one loses at most 4 MiB of its own to alignment).
PACK_BELOW = 32 << 20
PACK_BUFFER = 64 << 20  # bytes a packed buffer collects before the next one starts
_ALIGN = 64  # bytes: each parameter starts on a cache line (an address that is a multiple of it)


def _thp_on() -> bool:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            mode = f.read()
    except OSError:
        return False
    return "[always]" in mode or "[madvise]" in mode


def _to_line(buf: mx.array, used: int) -> int:
    """Move ``buf``'s first ``used`` elements up to its first address on a cache line, in place;
    the elements moved by. MLX's CPU allocator hands out ``malloc``'s pointer plus an 8-byte header,
    so a buffer, and every 64-byte offset in it, starts 8 bytes past a 16-byte boundary: half the
    32-byte loads of a row that starts there straddle two cache lines. The matmuls' tiles load a
    weight row and an activation row per multiply-add chain, and ran measurably slower with both
    off a line (docs/benchmarks/index.md). The same values: only their addresses move."""
    raw = np.frombuffer(memoryview(buf), dtype=np.uint8)
    nbytes = used * buf.dtype.size
    lead = -raw.ctypes.data % _ALIGN
    if lead % buf.dtype.size or lead + nbytes > raw.nbytes:
        return 0  # not reachable by whole elements (or no room): left where it is
    if lead:
        raw[lead:lead + nbytes] = raw[:nbytes].copy()
    return lead // buf.dtype.size


def pack(model) -> list[mx.array]:
    """Copy ``model``'s parameters under :data:`PACK_BELOW` bytes into shared buffers (consecutive
    parameters of one dtype, up to :data:`PACK_BUFFER` bytes each) and make each parameter a view of
    its buffer. The same values, shapes and dtypes. Returns what to :func:`advise` for the model's
    weights: the buffers (evaluated) and the parameters left as they were, those of
    :data:`PACK_BELOW` bytes and more. Nothing is copied where :func:`advise` would do nothing (not
    Linux, not the CPU, THP off); a model packed before is left as it is (the same list again)."""
    done = getattr(model, "_mlxq_packed", None)
    if done is not None:
        return done
    flat = tree_flatten(model.parameters())
    large = [a for _, a in flat if a.nbytes >= PACK_BELOW]
    if not _on_linux_cpu() or not _thp_on():
        return large
    # one run of buffers per dtype, each parameter in model order: a packed layer's uint32 weights,
    # float16 scales and float32 norms alternate, and runs split at each change of dtype held a few
    # parameters each, too few bytes for a huge page
    groups: list[list[tuple[str, mx.array]]] = []
    open_group: dict = {}  # dtype -> (its group being filled, bytes in it)
    for name, a in flat:
        if a.nbytes >= PACK_BELOW or a.size == 0:
            continue
        group, size = open_group.get(a.dtype, (None, 0))
        if group is None or size + a.nbytes > PACK_BUFFER:
            group, size = [], 0
            groups.append(group)
        group.append((name, a))
        open_group[a.dtype] = (group, size + a.nbytes)
    buffers, packed = [], 0
    for group in groups:
        if sum(a.nbytes for _, a in group) < 2 * HUGE:
            continue  # no 2 MiB page would fit inside it either
        packed += len(group)
        dtype = group[0][1].dtype
        step = max(1, _ALIGN // dtype.size)
        parts, offsets, off = [], [], 0
        for _, a in group:
            offsets.append(off)
            parts.append(a.reshape(-1))
            pad = -a.size % step
            if pad:
                parts.append(mx.zeros((pad,), dtype=dtype))
            off += a.size + pad
        buf = mx.concatenate(parts + [mx.zeros((step,), dtype=dtype)])  # room to move to a line
        mx.eval(buf)
        shift = _to_line(buf, off)
        views = [(name, buf[shift + o:shift + o + a.size].reshape(a.shape)) for (name, a), o in zip(group, offsets)]
        mx.eval([v for _, v in views])
        model.update(tree_unflatten(views))
        buffers.append(buf)
    if buffers:
        log.info("huge pages: %d parameters packed into %d buffers (%.0f MiB)",
                 packed, len(buffers), sum(b.nbytes for b in buffers) / 2**20)
    object.__setattr__(model, "_mlxq_packed", buffers + large)
    return model._mlxq_packed
