"""The n samples of one job share one prefill (``SeqSpec.fork_of``: the sibling, sample 0).

A sample waits until its sibling computed the shared prompt, then takes the sibling's full
blocks (one more reference each, like prefix-cache hits) and a copy of its last partial block
(the prefill plan's ``copies``, made by the model runner before the pass), and computes only
its own last token(s).  A sample still waiting when its sibling's prompt ends draws its first
token from the sibling's logits in that pass (the plan's ``firsts``), so all n samples decode
from the next step on, none a step behind.  A sibling that is gone means an ordinary admission.

Plain Python over ``Sequence`` and the ``BlockManager``; the scheduler decides when.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Optional

from .api import SeqSpec
from .block_manager import BlockManager, PrefixHit
from .sequence import Sequence, SequenceStatus, StepCounters

log = logging.getLogger(__name__)


def checked(spec: SeqSpec) -> SeqSpec:
    """The spec, its fork fields dropped when they cannot hold (logged): then it is not forked."""
    if spec.fork_of is not None and (spec.fork_of == spec.uid or not 0 < spec.fork_len <= len(spec.prompt)):
        log.warning("%s: fork_of %s with fork_len %d of a %d-token prompt: not forked",
                    spec.uid, spec.fork_of, spec.fork_len, len(spec.prompt))
        return replace(spec, fork_of=None, fork_len=0)
    return spec


def share_len(seq: Sequence) -> int:
    """Tokens a forked sample takes from its sibling: the shared prompt, less the last token when
    nothing of its own follows (that token's logits must be its own)."""
    return min(seq.spec.fork_len, len(seq.tokens) - 1)


class Forks:
    def __init__(self, bm: BlockManager, counters: StepCounters):
        self.bm = bm
        self.block_size = bm.block_size
        self.counters = counters
        self.copies: list[tuple[int, int]] = []  # block copies of forks admitted this step (sources pinned)
        self._samples: dict[str, set[str]] = {}  # job id -> the uids of its live samples ("job#i")

    def join(self, seq: Sequence) -> None:
        """A sequence entered the engine (a sample of a job: its uid is ``job#i``)."""
        job, sep, _ = seq.uid.rpartition("#")
        if sep:
            self._samples.setdefault(job, set()).add(seq.uid)

    def leave(self, seq: Sequence) -> None:
        job, sep, _ = seq.uid.rpartition("#")
        samples = self._samples.get(job) if sep else None
        if samples is not None:
            samples.discard(seq.uid)
            if not samples:
                del self._samples[job]

    def samples_of(self, job_id: str) -> set[str]:
        """The uids of the job's samples in the engine."""
        return self._samples.get(job_id, set())

    def held(self, seq: Sequence, live: dict[str, Sequence]) -> bool:
        """A sample whose sibling is about to compute the shared prompt: it waits for it."""
        sibling = live.get(seq.spec.fork_of) if seq.spec.fork_of else None
        if sibling is None or sibling is seq:
            return False  # no sibling (gone, or never came): an ordinary admission
        if sibling.status is SequenceStatus.WAITING:
            return not sibling.spec.fork_of  # its sibling is queued here (a sample of a sample: no)
        return sibling.status is SequenceStatus.PREFILL and sibling.num_computed < share_len(seq)

    def source(self, seq: Sequence, running: dict[str, Sequence]) -> Optional[Sequence]:
        """The running sibling whose computed blocks ``seq`` shares (None: none, admit alone)."""
        sibling = running.get(seq.spec.fork_of) if seq.spec.fork_of else None
        share = share_len(seq)
        if (sibling is None or sibling is seq or share <= 0 or sibling.num_computed < share
                or sibling.tokens[:share] != seq.tokens[:share]):
            return None
        return sibling

    def hit(self, seq: Sequence, sibling: Sequence) -> tuple[PrefixHit, int]:
        """The sibling's full blocks of the shared tokens, taken like prefix-cache hits (one more
        reference each); the tokens the fork starts with computed."""
        n_full = share_len(seq) // self.block_size
        return PrefixHit(sibling.block_table[:n_full], sibling.block_hashes[:n_full]), share_len(seq)

    def admitted(self, seq: Sequence, sibling: Sequence, n_full: int) -> None:
        """Finish a forked admission: the copy of the sibling's last partial block (its source pinned
        until the plan carries it), and straight to decode when one token is left to compute."""
        if seq.num_computed % self.block_size:
            src = sibling.block_table[n_full]
            self.bm.ref([src])
            self.copies.append((src, seq.block_table[n_full]))
        if seq.num_uncomputed == 1:
            seq.status = SequenceStatus.DECODE  # its decode row computes its last prompt token
        seq.prefix_hit = min(sibling.prefix_hit, seq.num_computed)
        self.counters.fork_shared_tokens += seq.num_computed
        # context tokens it did not share (its first token drawn from the sibling's logits is none)
        self.counters.prompt_tokens += max(0, seq.num_context - seq.num_computed)

    def take_copies(self) -> list[tuple[int, int]]:
        """This step's block copies, for the plan; the runner copies before anything else writes,
        so the sources need no pin any more."""
        copies, self.copies = self.copies, []
        self.bm.deallocate([src for src, _ in copies])
        return copies

    def drop_copies(self, seq: Sequence) -> None:
        """A fork admitted this step is released before its copy was made (preempted at once,
        priority_gap 0): no copy."""
        if not self.copies:
            return
        dst_blocks = set(seq.block_table)
        dropped = [c for c in self.copies if c[1] in dst_blocks]
        self.copies = [c for c in self.copies if c[1] not in dst_blocks]
        self.bm.deallocate([src for src, _ in dropped])

    @staticmethod
    def firsts(ending: list[Sequence], waiting: list[Sequence]) -> list[tuple[Sequence, int]]:
        """The waiting forks of a pass's ending rows whose context is the sibling's, whole: their first
        token comes from the sibling's logits, (fork, index into ``ending``) (a constrained sample
        takes the ordinary path)."""
        by_uid = {seq.uid: (k, seq) for k, seq in enumerate(ending)}
        if not by_uid:
            return []
        out = []
        for w in waiting:
            k, sibling = by_uid.get(w.spec.fork_of, (None, None))
            # fork_len <= len(prompt): a context of fork_len tokens is the bare prompt, nothing emitted
            if (sibling is not None and w.grammar is None
                    and w.spec.fork_len == len(w.tokens) and w.tokens == sibling.tokens):
                out.append((w, k))
        return out
