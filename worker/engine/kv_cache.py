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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

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


@dataclass
class ModelKVShape:
    layers: list[LayerShape]
    dtype: object = mx.float32  # the dtype the model computes keys/values in

    def bytes_per_block(self, block_size: int = BLOCK_SIZE, itemsize: Optional[int] = None) -> int:
        itemsize = itemsize or self.dtype.size
        return sum(
            block_size * s.n_kv_heads * (s.k_head_dim + s.v_head_dim) * itemsize
            for s in self.layers
        )


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
    """

    def __init__(self, shape: ModelKVShape, num_blocks: int, block_size: int = BLOCK_SIZE,
                 dtype=mx.float32):
        self.shape = shape
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        self.scratch_block = num_blocks
        n = (num_blocks + 1) * block_size
        self.keys = [mx.zeros((s.n_kv_heads, n, s.k_head_dim), dtype) for s in shape.layers]
        self.values = [mx.zeros((s.n_kv_heads, n, s.v_head_dim), dtype) for s in shape.layers]
        mx.eval(self.keys, self.values)
        # The fused paged-attention op when the engine uses one (set by
        # attention.use_attention); None: layers gather their blocks (the reference path).
        self.attention = None
        # With it, the same extension's in-place writer (keys, values -> pool rows);
        # None: MLX scatters.
        self.kv_write = None

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.keys) + sum(a.nbytes for a in self.values)

    def arrays(self) -> list[mx.array]:
        return self.keys + self.values

    def read_blocks(self, block_ids: Sequence[int]) -> dict[str, mx.array]:
        """Copies of the given blocks, per layer (for spilling to disk)."""
        slots = _slots_of_blocks(block_ids, self.block_size)
        out = {}
        for i, (k, v) in enumerate(zip(self.keys, self.values)):
            out[f"k{i}"] = k[:, slots]
            out[f"v{i}"] = v[:, slots]
        mx.eval(out)
        return out

    def write_blocks(self, block_ids: Sequence[int], data: dict[str, mx.array]) -> None:
        slots = _slots_of_blocks(block_ids, self.block_size)
        for i in range(len(self.keys)):
            self.keys[i][:, slots] = data[f"k{i}"].astype(self.keys[i].dtype)
            self.values[i][:, slots] = data[f"v{i}"].astype(self.values[i].dtype)
        mx.eval(self.keys, self.values)


    def copy_blocks(self, src_ids: Sequence[int], dst_ids: Sequence[int]) -> None:
        """Block ``dst_ids[i]`` becomes a copy of block ``src_ids[i]``, in every array of the pool
        (slot axis 1, whatever the arrays hold): a forked sequence's copy of its sibling's last
        partial block.  Lazy, like the pass writes: the arrays' data dependencies order it after
        every write already issued and before every later one (the caller evaluates it)."""
        if not src_ids:
            return
        src = _slots_of_blocks(src_ids, self.block_size)
        dst = _slots_of_blocks(dst_ids, self.block_size)
        for a in self.arrays():
            a[:, dst] = a[:, src]  # updates the pool's own array object (mx.array.__setitem__)


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
        v = self.view
        B, H, N, Dk = keys.shape
        Dv = values.shape[3]
        pk, pv = self.pool.keys[self.layer], self.pool.values[self.layer]
        if self.pool.kv_write is not None and keys.dtype == pk.dtype and values.dtype == pv.dtype:
            # in place (the pool arrays are replaced by the op's outputs, which share their buffers)
            pk, pv = self.pool.kv_write(pk, pv, keys, values, v.write_slots)
        else:
            k_new = keys.transpose(1, 0, 2, 3).reshape(H, B * N, Dk)
            v_new = values.transpose(1, 0, 2, 3).reshape(H, B * N, Dv)
            pk[:, v.write_slots] = k_new.astype(pk.dtype)
            pv[:, v.write_slots] = v_new.astype(pv.dtype)
        self.pool.keys[self.layer], self.pool.values[self.layer] = pk, pv
        if self.pool.attention is not None:
            # The fused op reads the blocks in place: the model's attention call
            # goes to attention.py's dispatch, which checks it gets these back untouched.
            self.handed_out = (keys, values)
            return keys, values
        return self._gather(pk, Dk), self._gather(pv, Dv)

    def gathered(self) -> tuple[mx.array, mx.array]:
        """This layer's keys and values as dense (B, H, L, D) copies (the reference path)."""
        s = self.pool.shape.layers[self.layer]
        return (self._gather(self.pool.keys[self.layer], s.k_head_dim),
                self._gather(self.pool.values[self.layer], s.v_head_dim))

    def _gather(self, pool_arr: mx.array, D: int) -> mx.array:
        v = self.view
        H = pool_arr.shape[0]
        bs = v.block_size
        B = len(v.rows)
        blocks = pool_arr.reshape(H, -1, bs, D)
        # Two broadcast index arrays make the gather write (B, H, nb, bs, D)
        # directly: contiguous, so attention reads it without a strided copy.
        # (mx.take(axis=1) and a transposed view are both 2-10x slower on CPU.)
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
        bs = self.view.block_size
        s = self.pool.shape.layers[self.layer]
        per_block = bs * s.n_kv_heads * (s.k_head_dim + s.v_head_dim) * self.pool.keys[0].itemsize
        return per_block * len({b for r in self.view.rows for b in r.block_table})


def make_layer_caches(pool: KVPool, view: BatchView) -> list[PagedLayerCache]:
    return [PagedLayerCache(pool, i, view) for i in range(len(pool.keys))]
