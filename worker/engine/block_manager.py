"""Block bookkeeping for the paged KV cache: pure Python, never touches a tensor.

The pool holds ``num_blocks`` fixed-size blocks.  A block is

* **used** while at least one owner (a running sequence, a hot session)
  references it (``ref_count > 0``);
* **cached** when unreferenced but still carrying the hash of the full block of
  tokens it holds (a prefix-cache entry, reusable by a later prompt);
* **free** when unreferenced and without a hash.

Cached and free blocks both live in one LRU list (``OrderedDict``, oldest
first); allocation takes the oldest, so a freed sequence's tail blocks (pushed
first) go before its head, and a cached block's hash is dropped only when its
memory is reused (an *eviction*).  Full blocks are keyed by a chained hash of
``(parent hash, tokens, model id)``; a lookup also compares the tokens.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Optional, Sequence

from ...shared.engine_config import BLOCK_SIZE  # 32: the one supported size (a setting)


def block_hash(parent: Optional[bytes], tokens: Sequence[int], model_id: str) -> bytes:
    """Stable (cross-process) hash of one full block chained to its parent."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"\0" * 16)
    h.update(model_id.encode())
    h.update(struct.pack(f"<{len(tokens)}q", *tokens))
    return h.digest()


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: Optional[bytes] = None
    tokens: tuple = ()


@dataclass
class BlockCounts:
    total: int
    used: int
    cached: int
    free: int


@dataclass
class PrefixHit:
    block_ids: list[int] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int = BLOCK_SIZE, model_id: str = ""):
        if num_blocks <= 0:
            raise ValueError("num_blocks must be positive")
        self.block_size = block_size
        self.model_id = model_id
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._lru: "OrderedDict[int, None]" = OrderedDict((i, None) for i in range(num_blocks))
        self._by_hash: dict[bytes, int] = {}
        self.evictions = 0

    # ----------------------------------------------------------------- counts
    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_unreferenced(self) -> int:
        """Blocks an allocation may take (free plus cached)."""
        return len(self._lru)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._lru)

    def counts(self) -> BlockCounts:
        cached = sum(1 for b in self._lru if self.blocks[b].hash is not None)
        unref = len(self._lru)
        return BlockCounts(self.num_blocks, self.num_blocks - unref, cached, unref - cached)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ----------------------------------------------------------- prefix cache
    def lookup(self, tokens: Sequence[int], max_tokens: int) -> PrefixHit:
        """Longest run of cached full blocks that prefix ``tokens[:max_tokens]``."""
        hit = PrefixHit()
        parent = None
        bs = self.block_size
        for i in range(max(0, max_tokens) // bs):
            chunk = tuple(tokens[i * bs:(i + 1) * bs])
            parent = block_hash(parent, chunk, self.model_id)
            bid = self._by_hash.get(parent)
            if bid is None or self.blocks[bid].tokens != chunk:
                break
            hit.block_ids.append(bid)
            hit.hashes.append(parent)
        return hit

    def can_allocate(self, num_new_blocks: int, hit: Optional[PrefixHit] = None) -> bool:
        """Whether ``num_new_blocks`` fresh blocks fit beside the hit blocks."""
        pinned_from_lru = 0
        if hit is not None:
            pinned_from_lru = sum(1 for b in hit.block_ids if self.blocks[b].ref_count == 0)
        return num_new_blocks <= len(self._lru) - pinned_from_lru

    def allocate(self, num_new_blocks: int, hit: Optional[PrefixHit] = None) -> list[int]:
        """Reference the hit blocks, then take ``num_new_blocks`` fresh ones."""
        if not self.can_allocate(num_new_blocks, hit):
            raise MemoryError("not enough free blocks")
        table: list[int] = []
        if hit is not None:
            for bid in hit.block_ids:
                self._ref(bid)
                table.append(bid)
        for _ in range(num_new_blocks):
            table.append(self._take_fresh())
        return table

    def can_append(self) -> bool:
        return len(self._lru) > 0

    def append_block(self) -> int:
        if not self._lru:
            raise MemoryError("no free block")
        return self._take_fresh()

    def grow_table(self, table: list[int], positions: int, keep_free: int) -> int:
        """Append blocks to ``table`` until it holds ``positions`` slots, while more than ``keep_free``
        blocks stay unreferenced; the slots it holds then (speculation's room for a proposal)."""
        while len(table) < self.blocks_needed(positions) and self.num_unreferenced > keep_free:
            table.append(self.append_block())
        return len(table) * self.block_size

    def shrink_table(self, table: list[int], positions: int) -> None:
        """Give back ``table``'s blocks past its first ``positions`` slots (a proposal's unused ones)."""
        extra = table[self.blocks_needed(positions):]
        if extra:
            del table[-len(extra):]
            self.deallocate(extra)

    def ref(self, block_ids: Sequence[int]) -> None:
        """Add one reference to each block (a session pinning its blocks)."""
        for bid in block_ids:
            self._ref(bid)

    def deallocate(self, block_ids: Sequence[int]) -> None:
        """Drop one reference per block; tail blocks become reusable first."""
        for bid in reversed(block_ids):
            b = self.blocks[bid]
            if b.ref_count <= 0:
                raise ValueError(f"block {bid} is not referenced")
            b.ref_count -= 1
            if b.ref_count == 0:
                self._lru[bid] = None  # newest end: reused last

    def commit(self, block_id: int, parent: Optional[bytes], tokens: Sequence[int]) -> bytes:
        """Register a now-full, computed block under its chained hash."""
        tokens = tuple(tokens)
        if len(tokens) != self.block_size:
            raise ValueError("only full blocks can be committed")
        h = block_hash(parent, tokens, self.model_id)
        b = self.blocks[block_id]
        if b.hash == h:
            return h
        if b.hash is not None and self._by_hash.get(b.hash) == block_id:
            del self._by_hash[b.hash]
        b.hash, b.tokens = h, tokens
        # First writer wins; a duplicate keeps working as a private block.
        self._by_hash.setdefault(h, block_id)
        return h

    def commit_full(self, table: Sequence[int], hashes: list[bytes], tokens: Sequence[int], num_tokens: int) -> None:
        """Commit each full block of ``table`` within its first ``num_tokens`` tokens that ``hashes``
        (the chain committed so far) does not cover yet, extending ``hashes``."""
        bs = self.block_size
        while len(hashes) < num_tokens // bs:
            i = len(hashes)
            hashes.append(self.commit(table[i], hashes[-1] if hashes else None, tokens[i * bs:(i + 1) * bs]))

    # --------------------------------------------------------------- internal
    def _ref(self, bid: int) -> None:
        b = self.blocks[bid]
        if b.ref_count == 0:
            del self._lru[bid]
        b.ref_count += 1

    def _take_fresh(self) -> int:
        bid, _ = self._lru.popitem(last=False)
        b = self.blocks[bid]
        if b.hash is not None:
            self._forget(b)
        b.ref_count = 1
        return bid

    def _forget(self, b: Block) -> None:
        if self._by_hash.get(b.hash) == b.block_id:
            del self._by_hash[b.hash]
        b.hash, b.tokens = None, ()
        self.evictions += 1

    def check_invariants(self) -> None:
        """Raise AssertionError when the bookkeeping is inconsistent (tests)."""
        for b in self.blocks:
            assert b.ref_count >= 0, b
            assert (b.ref_count == 0) == (b.block_id in self._lru), b
        for h, bid in self._by_hash.items():
            assert self.blocks[bid].hash == h
        assert len(self._lru) <= self.num_blocks
