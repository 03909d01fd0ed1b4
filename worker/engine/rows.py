"""Which running sequences a pass computes: the rows of a ragged prefill pass within the step's token
budget, the rows of a decode launch, and the slots a verify pass's rows get for their proposals.
Plain functions of the running sequences and the pool: the ``Scheduler`` keeps the state."""

from __future__ import annotations

from typing import Iterable, Sequence as Seq

from ...shared.engine_config import EngineConfig
from .block_manager import BlockManager
from .sequence import Sequence, SequenceStatus


def prefill_rows(running: Iterable[Sequence], config: EngineConfig, budget: int) -> list[tuple[Sequence, int]]:
    """The rows of one ragged prefill pass, (sequence, tokens this pass), most urgent first within
    the token budget; the padded size (rows x the longest chunk) too, so a long chunk does not
    drag many short rows' padding along."""
    todo = sorted((s for s in running if s.status is SequenceStatus.PREFILL), key=Sequence.rank)
    picked: list[tuple[Sequence, int]] = []
    width, left = 0, budget
    for seq in todo:
        if left <= 0:
            break
        n = seq.num_uncomputed
        if config.chunked_prefill:
            n = min(n, config.chunk_size(seq.num_computed), left)
        if picked and max(width, n) * (len(picked) + 1) > budget:
            break
        picked.append((seq, n))
        width = max(width, n)
        left -= n
    return picked


def decode_rows(running: Iterable[Sequence], skip: Seq[Sequence]) -> list[Sequence]:
    """The decoding rows of a launch, most urgent first; a row whose pending token is its last
    (max_tokens) needs no launch."""
    skipped = {id(s) for s in skip}
    return sorted((s for s in running
                   if s.status is SequenceStatus.DECODE and id(s) not in skipped
                   and s.emitted + s.pending < s.spec.max_tokens), key=Sequence.rank)


def proposal_slots(bm: BlockManager, rows: list[Sequence], ks: list[int], keep_free: int) -> list[int]:
    """Slots for each row's proposal of ``ks[i]`` tokens (its rows settled: nothing pending), from
    blocks no one holds, never the last ``keep_free``; the k each row got slots for."""
    return [max(0, min(k, bm.grow_table(seq.block_table, seq.num_computed + 1 + k, keep_free)
                       - seq.num_computed - 1)) for seq, k in zip(rows, ks)]
