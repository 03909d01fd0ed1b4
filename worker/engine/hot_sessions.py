"""Hot sessions: a finished turn's full blocks stay pinned in the pool for the session's next turn.

Plain Python over the ``BlockManager``; no MLX.  The scheduler keeps a session when its turn
finishes, spills the least recently used one when it needs blocks, and restores a spilled one
before a new turn's prompt is looked up in the prefix cache.  Spilling writes the blocks through
``sessions.SessionFiles`` (which moves the tensors; None: no session dir, a spilled session is
dropped) and unpins them: they stay in the prefix cache until reused.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

from .block_manager import BlockManager, PrefixHit
from .sequence import Sequence, StepCounters

log = logging.getLogger(__name__)


@dataclass
class HotSession:
    """A finished turn whose full blocks stay pinned in the pool for the next turn."""

    session_id: str
    block_ids: list[int]
    tokens: list[int]  # the tokens of those full blocks


class HotSessions:
    def __init__(self, bm: BlockManager, files, counters: StepCounters):
        self.bm = bm
        self.files = files  # sessions.SessionFiles, or None
        self.counters = counters
        self.by_id: "OrderedDict[str, HotSession]" = OrderedDict()  # least recently used first

    def __len__(self) -> int:
        return len(self.by_id)

    def keep(self, seq: Sequence) -> None:
        """Pin the full blocks of a finished turn (replacing the session's older turn)."""
        n_full = len(seq.block_hashes)
        if n_full == 0:
            return
        blocks = seq.block_table[:n_full]
        self.bm.ref(blocks)
        sid = seq.spec.session_id
        old = self.by_id.pop(sid, None)
        self.by_id[sid] = HotSession(sid, blocks, seq.tokens[:n_full * self.bm.block_size])
        if old is not None:
            self.bm.deallocate(old.block_ids)

    def spill_one(self) -> bool:
        """Write the least recently used hot session to disk and unpin it (False: none is hot)."""
        if not self.by_id:
            return False
        _, hot = self.by_id.popitem(last=False)
        if self.files is not None:
            self.files.spill(hot.session_id, hot.block_ids, hot.tokens)
        self.bm.deallocate(hot.block_ids)
        self.counters.session_spills += 1
        return True

    def spill_all(self) -> None:
        while self.spill_one():
            pass

    def prefix_hit(self, seq: Sequence) -> PrefixHit:
        """The prefix-cache hit of a sequence's context (its last token left to compute), its
        session's spilled blocks restored into the cache first (once per sequence)."""
        if seq.spec.session_id and not seq.session_checked:
            seq.session_checked = True
            self.restore(seq)
        return self.bm.lookup(seq.tokens, len(seq.tokens) - 1)

    def restore(self, seq: Sequence) -> None:
        """Load a warm session's blocks into the prefix cache when they help."""
        sid = seq.spec.session_id
        if sid in self.by_id:
            self.by_id.move_to_end(sid)
            return
        bs = self.bm.block_size
        warm = self.files.load(sid) if self.files is not None else None
        if warm is None:
            return
        n_blocks = min(len(warm.tokens), len(seq.tokens) - 1) // bs
        while n_blocks and warm.tokens[:n_blocks * bs] != seq.tokens[:n_blocks * bs]:
            n_blocks -= 1
        hit = self.bm.lookup(seq.tokens, n_blocks * bs)
        need = n_blocks - hit.num_blocks
        if need <= 0 or not self.bm.can_allocate(need, hit):
            return
        # Reference the blocks already in the pool (so allocating cannot evict
        # them), load the rest into fresh blocks and register their hashes.
        table = self.bm.allocate(need, hit)
        self.files.restore(warm, table[hit.num_blocks:], hit.num_blocks * bs, n_blocks * bs)
        self.bm.commit_full(table, list(hit.hashes), seq.tokens, n_blocks * bs)
        self.bm.deallocate(table)  # now cached; the lookup that follows takes them
        self.counters.session_restores += 1
        log.debug("session %s restored: %d of %d blocks from disk", sid, need, n_blocks)
