"""mlx-lm's KV-cache protocol over a preallocated block pool.

``KVPool`` holds, per layer, one key and one value array of shape
``(n_kv_heads, (num_blocks + 1) * block_size, head_dim)`` in the model's
compute dtype.  A forward pass runs
over a ``BatchView``: the rows of the batch, each with its block table, its
cache offset and the number of new tokens it feeds.  ``make_layer_caches``
returns one ``PagedLayerCache`` per model layer; the unmodified mlx-lm model
calls ``offset`` (RoPE position), ``make_mask`` and ``update_and_fetch`` on it.

``update_and_fetch`` writes the new keys/values into the pool at the rows'
slots (in place with the CPU extension's ``paged_kv_write``, else an MLX
scatter) and, without a fused attention op, gathers each row's blocks back as
a dense ``(B, H, L, D)`` view (L = the longest row), which the stock attention
consumes with a mask that hides padding.  Sliding-window layers are stored in full and masked to their window.

Quantized blocks (``KVQuant``, ``--kv-bits 8|4``): each layer's keys and values are
stored in ``mx.quantize``'s layout, packed uint32 rows ``(H, S, D * bits / 32)`` plus
per-group scales and biases ``(H, S, D / group_size)`` in the model's dtype (affine,
as mlx-lm's ``QuantizedKVCache``). Every array keeps the slot axis at 1, so block
copies, spills and restores index them all alike. New rows are quantized at the step
they are written (``KVQuant.quantize``: ``mx.quantize``'s groups, each map then fit to
its values by least squares); the fused op reads the packed integers and applies the scales and
biases to its dot products (as MLX's quantized matmul), the gather path dequantizes
with ``mx.dequantize``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import mlx.core as mx
import numpy as np
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import make_prompt_cache

from .block_manager import BLOCK_SIZE


@dataclass
class LayerShape:
    n_kv_heads: int
    k_head_dim: int
    v_head_dim: int


KV_BITS = (4, 8)
KV_GROUP_SIZES = (32, 64, 128)
REFIT_ROUNDS = 2  # KVQuant.quantize: least-squares refits of a group's map, each then rounded again


@dataclass(frozen=True)
class KVQuant:
    """Quantized KV storage: ``bits`` per element, one scale and bias per ``group_size``."""

    bits: int
    group_size: int  # the engine passes its config's (EngineConfig.kv_group_size)

    def check(self, head_dims) -> None:
        """Raise ValueError (one line) for a width or group this pool cannot store."""
        if self.bits not in KV_BITS:
            raise ValueError(f"kv_bits={self.bits}: only 4 or 8 bit KV blocks are supported")
        if self.group_size not in KV_GROUP_SIZES:
            raise ValueError(f"kv_group_size={self.group_size}: must be one of 32, 64, 128")
        bad = sorted({d for d in head_dims if d % self.group_size})
        if bad:
            raise ValueError(f"kv_group_size={self.group_size} does not divide the model's head dims {bad}")

    def quantize(self, x: mx.array, dtype, op: Optional[Callable] = None) -> tuple[mx.array, mx.array, mx.array]:
        """``x`` (..., D) as packed integers, scales and biases in ``mx.quantize``'s layout (the
        scales and biases in ``dtype``), each group's affine map fit to its values.

        ``mx.quantize`` picks a group's map from its range (min to max, the end of larger
        magnitude exact). From there, ``REFIT_ROUNDS`` times: the scale and bias of the
        least-squares line through the group's (integer, value) points, then each value rounded
        to its nearest integer of that map (clipped to the bits); last, the line through the final
        integers. Neither step can raise the group's sum of squared errors (the line is the best
        map for those integers, the rounding the best integers for that map), so no group ends
        worse than ``mx.quantize`` leaves it; a group of one repeated integer keeps its map. Each
        group on its own, in fp32: a row's bits do not depend on the rows written with it.
        What the refits buy, measured: docs/design/engine-notes.md.

        ``op``: the CPU extension's ``kv_quantize``, the same arithmetic as one primitive (bit for
        bit these MLX ops, checked when it loads: ``model_ops.check_kv_quantize``), where the ops
        below are ~45 tasks per call.
        """
        g, bits = self.group_size, self.bits
        xq, s, b = mx.quantize(x, group_size=g, bits=bits)
        if op is not None:
            f32 = mx.float32
            packed, scale, bias = op(x.astype(f32), xq, s.astype(f32), b.astype(f32), g, bits, REFIT_ROUNDS)
            return packed, scale.astype(dtype), bias.astype(dtype)
        top = float((1 << bits) - 1)
        q = mx.dequantize(xq, mx.ones_like(s), mx.zeros_like(b), group_size=g, bits=bits, dtype=mx.float32)
        groups = x.shape[:-1] + (x.shape[-1] // g, g)
        xg, q = x.astype(mx.float32).reshape(groups), q.reshape(groups)
        mean_x = xg.mean(axis=-1, keepdims=True)
        scale, bias = s.astype(mx.float32)[..., None], b.astype(mx.float32)[..., None]
        for r in range(REFIT_ROUNDS + 1):
            mean_q = q.mean(axis=-1, keepdims=True)
            dq = q - mean_q
            var, cov = (dq * dq).sum(axis=-1, keepdims=True), (dq * xg).sum(axis=-1, keepdims=True)
            fit = (var > 0) & (cov != 0)  # else the integers do not spread, or do not follow x
            scale = mx.where(fit, cov / mx.where(fit, var, 1.0), scale)
            bias = mean_x - scale * mean_q
            if r < REFIT_ROUNDS:
                q = mx.clip(mx.round((xg - bias) / scale), 0.0, top)
        packed = _pack(q.reshape(x.shape).astype(mx.uint32), bits)
        return packed, scale[..., 0].astype(dtype), bias[..., 0].astype(dtype)

    def row_bytes(self, dim: int, itemsize: int) -> int:
        """Bytes of one token's row of one head: packed values, scales and biases."""
        return dim * self.bits // 8 + 2 * (dim // self.group_size) * itemsize


def _pack(q: mx.array, bits: int) -> mx.array:
    """Integers (..., D) < 2**bits as mx.quantize packs them: element e in bits (e * bits) % 32 of
    uint32 word (e * bits) // 32 (the fields are disjoint, so their sum is their bitwise or)."""
    per = 32 // bits
    fields = q.reshape(q.shape[:-1] + (q.shape[-1] // per, per))
    return (fields << (mx.arange(per, dtype=mx.uint32) * bits)).sum(axis=-1).astype(mx.uint32)


def make_kv_quant(bits: Optional[int], group_size: int) -> Optional[KVQuant]:
    return None if bits is None else KVQuant(int(bits), int(group_size))


@dataclass
class ModelKVShape:
    layers: list[LayerShape]
    dtype: object = mx.float32  # the dtype the model computes keys/values in

    def head_dims(self) -> set[int]:
        return {d for s in self.layers for d in (s.k_head_dim, s.v_head_dim)}

    def bytes_per_block(self, block_size: int = BLOCK_SIZE, itemsize: Optional[int] = None,
                        quant: Optional[KVQuant] = None) -> int:
        return sum(self.layer_block_bytes(i, block_size, itemsize, quant) for i in range(len(self.layers)))

    def layer_block_bytes(self, layer: int, block_size: int = BLOCK_SIZE, itemsize: Optional[int] = None,
                          quant: Optional[KVQuant] = None) -> int:
        itemsize = itemsize or self.dtype.size
        s = self.layers[layer]
        dims = (s.k_head_dim, s.v_head_dim)
        row = sum(quant.row_bytes(d, itemsize) if quant else d * itemsize for d in dims)
        return block_size * s.n_kv_heads * row


class _ShapeProbe:
    """A throwaway cache that records the key/value shapes each layer produces."""

    def __init__(self):
        self.offset = 0
        self.shape: Optional[LayerShape] = None
        self.dtype = None

    def update_and_fetch(self, keys, values):
        self.shape = LayerShape(keys.shape[1], keys.shape[3], values.shape[3])
        self.dtype = keys.dtype
        return keys, values

    def make_mask(self, N, return_array=False, window_size=None):
        return create_causal_mask(N, 0, window_size=window_size) if N > 1 else None


def probe_kv_shape(model) -> ModelKVShape:
    """Run one token through the model to learn each layer's KV shape."""
    n_layers = len(make_prompt_cache(model))
    probes = [_ShapeProbe() for _ in range(n_layers)]
    mx.eval(model(mx.array([[0]]), cache=probes))
    if any(p.shape is None for p in probes):
        raise ValueError("model has layers that do not use a KV cache")
    return ModelKVShape([p.shape for p in probes], probes[0].dtype)


class KVPool:
    """The preallocated per-layer key/value block pool.

    One extra *scratch* block (id ``num_blocks``, never handed out by the block
    manager) takes the writes of a ragged batch's padding positions.

    ``store`` maps a part name to its per-layer arrays: ``k`` and ``v`` (the float
    rows, or the packed ones when quantized) and, quantized, ``ks``/``kb``/``vs``/``vb``
    (scales and biases). ``keys``/``values`` are the ``k``/``v`` lists themselves.
    """

    def __init__(self, shape: ModelKVShape, num_blocks: int, block_size: int = BLOCK_SIZE,
                 dtype=mx.float32, quant: Optional[KVQuant] = None):
        if quant is not None:
            quant.check(shape.head_dims())
        self.shape = shape
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        self.quant = quant
        self.scratch_block = num_blocks
        n = (num_blocks + 1) * block_size
        self.store: dict[str, list[mx.array]] = {}
        for side, dim_of in (("k", lambda s: s.k_head_dim), ("v", lambda s: s.v_head_dim)):
            for part, (width, dt) in self._parts(dtype).items():
                self.store[side + part] = [mx.zeros((s.n_kv_heads, n, width(dim_of(s))), dt)
                                           for s in shape.layers]
        self.keys, self.values = self.store["k"], self.store["v"]
        mx.eval(self.arrays())
        # The fused paged-attention op when the engine uses one (set by
        # attention.use_attention); None: layers gather their blocks (the reference path).
        self.attention = None
        # With it, the same extension's in-place writer (keys, values -> pool rows);
        # None: MLX scatters.
        self.kv_write = None
        self.kv_quantize: Optional[Callable] = None  # the extension's, for quantized blocks (KVQuant.quantize)

    def _parts(self, dtype) -> dict:
        """Part suffix -> (row width from the head dim, dtype)."""
        q = self.quant
        if q is None:
            return {"": (lambda d: d, dtype)}
        return {"": (lambda d: d * q.bits // 32, mx.uint32),
                "s": (lambda d: d // q.group_size, dtype),
                "b": (lambda d: d // q.group_size, dtype)}

    @property
    def layout(self) -> str:
        """What a block's bytes mean (session files of another layout are not loaded)."""
        q = self.quant
        return f"{self.dtype}" if q is None else f"{self.dtype}/q{q.bits}g{q.group_size}"

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays())

    def arrays(self) -> list[mx.array]:
        return [a for arrs in self.store.values() for a in arrs]

    def quant_kwargs(self, layer: int) -> dict:
        """The attention op's extra arguments for this layer's quantized blocks ({} if float)."""
        q = self.quant
        if q is None:
            return {}
        st = self.store
        return dict(k_scales=st["ks"][layer], k_biases=st["kb"][layer], v_scales=st["vs"][layer],
                    v_biases=st["vb"][layer], bits=q.bits, group_size=q.group_size)

    def write_rows(self, layer: int, keys: mx.array, values: mx.array, slots: mx.array) -> None:
        """Store new keys/values (B, H, N, D) at pool rows ``slots`` (B*N,), quantized if the pool is."""
        rows = {"k": keys, "v": values}
        if self.quant is not None:
            for side, x in (("k", keys), ("v", values)):
                rows[side], rows[side + "s"], rows[side + "b"] = self.quant.quantize(x, self.dtype, self.kv_quantize)
        for a, b in self._pairs():
            self._write_pair(a, b, layer, rows[a], rows[b], slots)

    def _write_pair(self, a: str, b: str, layer: int, x: mx.array, y: mx.array, slots: mx.array) -> None:
        pa, pb = self.store[a][layer], self.store[b][layer]
        if self.kv_write is not None and x.dtype == pa.dtype and y.dtype == pb.dtype:
            # in place (the pool arrays are replaced by the op's outputs, which share their buffers)
            pa, pb = self.kv_write(pa, pb, x, y, slots)
        else:
            for pool_arr, rows in ((pa, x), (pb, y)):
                B, H, N, W = rows.shape
                pool_arr[:, slots] = rows.transpose(1, 0, 2, 3).reshape(H, B * N, W).astype(pool_arr.dtype)
        self.store[a][layer], self.store[b][layer] = pa, pb

    def dequantize(self, side: str, layer: int, take) -> mx.array:
        """``take`` (a function of one pool array) applied to side ``k``/``v`` of a layer,
        dequantized to the pool's float dtype when the pool is quantized."""
        if self.quant is None:
            return take(self.store[side][layer])
        q = self.quant
        st = self.store
        return mx.dequantize(take(st[side][layer]), take(st[side + "s"][layer]), take(st[side + "b"][layer]),
                             group_size=q.group_size, bits=q.bits)

    def read_blocks(self, block_ids: Sequence[int]) -> dict[str, mx.array]:
        """Copies of the given blocks, per part and layer (for spilling to disk)."""
        slots = _slots_of_blocks(block_ids, self.block_size)
        out = {f"{name}{i}": a[:, slots] for name, arrs in self.store.items() for i, a in enumerate(arrs)}
        mx.eval(out)
        return out

    def write_blocks(self, block_ids: Sequence[int], data: dict[str, mx.array]) -> None:
        slots = _slots_of_blocks(block_ids, self.block_size)
        self._write_slots(slots, lambda name, i, a: data[f"{name}{i}"].astype(a.dtype))
        mx.eval(self.arrays())

    def _pairs(self) -> list[tuple[str, str]]:
        """The pool's parts in the pairs the in-place writer takes."""
        return [("k", "v")] + ([("ks", "kb"), ("vs", "vb")] if self.quant is not None else [])

    def _write_slots(self, slots: mx.array, rows_of) -> None:
        """Every array of the pool gets ``rows_of(part, layer, array)`` (H, len(slots), W) at
        ``slots``, pair by pair through :meth:`_write_pair`: in place with the extension's
        writer where the engine has it (MLX's scatter copies a whole layer array whenever a
        queued step still holds it, and the copy is off the pool's huge pages), else by MLX's
        scatter."""
        for a, b in self._pairs():
            for i in range(len(self.store[a])):
                x, y = rows_of(a, i, self.store[a][i]), rows_of(b, i, self.store[b][i])
                self._write_pair(a, b, i, x[None], y[None], slots)


    def copy_blocks(self, src_ids: Sequence[int], dst_ids: Sequence[int]) -> None:
        """Block ``dst_ids[i]`` becomes a copy of block ``src_ids[i]``, in every array of the pool
        (slot axis 1, whatever the arrays hold): a forked sequence's copy of its sibling's last
        partial block.  Lazy, like the pass writes: the arrays' data dependencies order it after
        every write already issued and before every later one (the caller evaluates it)."""
        if not src_ids:
            return
        src = _slots_of_blocks(src_ids, self.block_size)
        dst = _slots_of_blocks(dst_ids, self.block_size)
        self._write_slots(dst, lambda name, i, a: a[:, src])


def _slots_of_blocks(block_ids: Sequence[int], block_size: int) -> mx.array:
    ids = mx.array(list(block_ids), dtype=mx.int32)
    return (ids[:, None] * block_size + mx.arange(block_size, dtype=mx.int32)[None]).reshape(-1)


@dataclass
class BatchRow:
    block_table: list[int]
    offset: int  # tokens already in the cache before this pass
    num_new: int  # tokens fed this pass (rows may differ: ragged prefill)


class BatchView:
    """Index arrays shared by every layer for one forward pass, built once.

    Rows are ragged: row ``b`` feeds ``num_new[b]`` real tokens, padded to
    ``num_new_max``.  Padding positions write their keys/values into the pool's
    scratch block (never a block any sequence owns) and are masked out.

    For attention backends: ``tables`` (B, nb) int32 block tables (padded with
    the row's first block), ``q_offsets`` (B,) int32 position of each row's
    first query, ``kv_lens`` (B,) int32 valid keys of each row after this pass.
    """

    def __init__(self, rows: list[BatchRow], block_size: int = BLOCK_SIZE,
                 scratch_block: Optional[int] = None):
        if not rows:
            raise ValueError("empty batch")
        self.rows = rows
        self.block_size = block_size
        bs = block_size
        B = len(rows)
        n_new = np.fromiter((r.num_new for r in rows), np.int64, B)
        offs = np.fromiter((r.offset for r in rows), np.int64, B)
        if (n_new < 1).any():
            raise ValueError("every row feeds at least one token")
        N = int(n_new.max())
        self.num_new = N
        self.ragged = bool((n_new != N).any())
        lens = offs + n_new
        self.max_len = int(lens.max())
        # every row at the same position (one sequence, or jobs that started
        # together): an int RoPE offset and the single-sequence masks serve all
        self.single = B == 1 or (not self.ragged and bool((offs == offs[0]).all()))
        nb = -(-self.max_len // bs)
        table = np.empty((B, nb), np.int64)
        for i, r in enumerate(rows):
            t = r.block_table[:nb]
            table[i, :len(t)] = t
            table[i, len(t):] = r.block_table[0]
        # write slots (B * N,): position p of row b -> table[b, p // bs] * bs + p % bs
        pos = offs[:, None] + np.arange(N)[None, :]  # (B, N)
        real = np.arange(N)[None, :] < n_new[:, None]
        blk = np.take_along_axis(table, np.minimum(pos // bs, nb - 1), axis=1)
        slots = blk * bs + pos % bs
        if self.ragged:
            if scratch_block is None:
                raise ValueError("a ragged batch needs the pool's scratch block")
            slots = np.where(real, slots, scratch_block * bs + np.arange(N)[None, :] % bs)
        self.write_slots = mx.array(slots.reshape(-1).astype(np.int32))  # (B * N,)
        self.tables = mx.array(table.astype(np.int32))  # (B, nb)
        self.q_offsets = mx.array(offs.astype(np.int32))  # (B,)
        self.kv_lens = mx.array(lens.astype(np.int32))  # (B,)
        self.num_table_blocks = nb
        self.lengths = lens.tolist()
        self.offsets = offs.tolist()
        self.num_new_rows = n_new.tolist()
        self.offset = self.offsets[0] if self.single else self.q_offsets
        self._masks: dict = {}
        self._mask_windows: dict = {}  # id(mask) -> the window it was built for
        self._head_index: dict = {}

    def head_index(self, n_heads: int) -> mx.array:
        if n_heads not in self._head_index:
            self._head_index[n_heads] = mx.arange(n_heads, dtype=mx.int32)[None, :, None]
        return self._head_index[n_heads]

    def make_mask(self, N: int, return_array: bool = False, window_size=None):
        key = (N, return_array, window_size)
        if key in self._masks:
            return self._masks[key]
        if self.single:
            off = self.offsets[0]
            if N == 1 and not return_array and (window_size is None or off < window_size):
                mask = None
            elif not return_array and (window_size is None or off + N <= window_size):
                mask = "causal"
            else:
                mask = create_causal_mask(N, off, window_size=window_size)
        else:
            q = self.q_offsets[:, None, None, None] + mx.arange(N, dtype=mx.int32)[None, None, :, None]
            k = mx.arange(self.max_len, dtype=mx.int32)[None, None, None, :]  # (1,1,1,L)
            mask = k <= q
            if self.ragged:
                # padded queries see only their row's real keys (their output is dropped)
                mask = mask & (k < self.kv_lens[:, None, None, None])
            if window_size is not None:
                mask = mask & (k > q - window_size)
        self._masks[key] = mask
        if isinstance(mask, mx.array):
            self._mask_windows[id(mask)] = window_size
        return mask

    def window_of(self, mask):
        """The sliding window a mask from ``make_mask`` stands for (None: none, or one
        that changes nothing), or ``NotImplemented`` for a mask this view did not make."""
        if mask is None or (isinstance(mask, str) and mask == "causal"):
            return None  # only returned where no window cuts anything off
        return self._mask_windows.get(id(mask), NotImplemented)


class PagedLayerCache:
    """One layer's view of the pool for one forward pass (mlx-lm cache protocol)."""

    handed_out = None  # fused attention: what update_and_fetch returned (attention.py checks)

    def __init__(self, pool: KVPool, layer: int, view: BatchView):
        self.pool = pool
        self.layer = layer
        self.view = view

    # --- protocol used by the model files
    @property
    def offset(self):
        return self.view.offset

    def make_mask(self, N: int, return_array: bool = False, window_size=None, **kwargs):
        return self.view.make_mask(N, return_array=return_array, window_size=window_size)

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        self.pool.write_rows(self.layer, keys, values, self.view.write_slots)
        if self.pool.attention is not None:
            # The fused op reads the blocks in place: the model's attention call
            # goes to attention.py's dispatch, which checks it gets these back untouched.
            self.handed_out = (keys, values)
            return keys, values
        return self.gathered()

    def gathered(self) -> tuple[mx.array, mx.array]:
        """This layer's keys and values as dense (B, H, L, D) copies (the reference path)."""
        return (self.pool.dequantize("k", self.layer, self._gather),
                self.pool.dequantize("v", self.layer, self._gather))

    def _gather(self, pool_arr: mx.array) -> mx.array:
        v = self.view
        H, _, D = pool_arr.shape
        bs = v.block_size
        B = len(v.rows)
        blocks = pool_arr.reshape(H, -1, bs, D)
        # Two broadcast index arrays make the gather write (B, H, nb, bs, D)
        # directly: contiguous, so attention reads it without a strided copy.
        # (mx.take(axis=1) and a transposed view are both slower on CPU.)
        g = blocks[v.head_index(H), v.tables[:, None, :]]
        return g.reshape(B, H, v.num_table_blocks * bs, D)[:, :, : v.max_len, :]

    # --- rest of the protocol (introspection, save/trim are not supported)
    @property
    def state(self):
        return ()

    @property
    def meta_state(self):
        return ""

    def is_trimmable(self) -> bool:
        return False

    def trim(self, n: int) -> int:
        return 0

    def size(self) -> int:
        return max(self.view.lengths)

    def empty(self) -> bool:
        return False

    @property
    def nbytes(self) -> int:
        pool = self.pool
        per_block = pool.shape.layer_block_bytes(self.layer, self.view.block_size, pool.dtype.size, pool.quant)
        return per_block * len({b for r in self.view.rows for b in r.block_table})


def make_layer_caches(pool: KVPool, view: BatchView) -> list[PagedLayerCache]:
    return [PagedLayerCache(pool, i, view) for i in range(len(pool.keys))]
