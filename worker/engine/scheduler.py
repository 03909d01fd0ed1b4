"""Who runs this step: the waiting and running sequences, admission under budgets, preemption.

Plain Python over :class:`Sequence` and :class:`BlockManager`; no MLX.  Each step the engine
asks for two plans and hands back what the model runner sampled:

1. ``schedule_prefill()`` admits waiting sequences, most urgent first, while their prompt blocks
   (less prefix-cache hits) plus a decode reserve stay under the pressure threshold, spilling hot
   sessions and preempting much less urgent sequences when needed; then it picks the prompt
   chunks of one ragged prefill pass (a token budget, chunk size by cache position);
2. ``schedule_decode()`` gives every other decoding sequence a slot for its new token,
   preempting the least urgent, newest sequence when the pool is full;
3. ``postprocess_*()`` appends the sampled tokens (``Sequence.append_token``: stop id or length),
   commits full blocks to the prefix cache and finishes sequences.

What is not policy lives beside it: ``intake`` (what the worker may hand over, and a spec made a
sequence), ``forks`` (the n samples of a job share one prefill), ``hot_sessions`` (a finished
turn's blocks kept for the next).  ``settle()``, wired in by the engine, reads the decode still
in flight (before a preemption, so a preempted job carries every token it generated).
"""

from __future__ import annotations

import itertools
import logging
from typing import Callable, Optional, Sequence as Seq

from ...shared.engine_config import EngineConfig

from .api import Preempted, SeqSpec, TokenEvent
from .block_manager import BlockManager, PrefixHit
from .forks import Forks
from .hot_sessions import HotSessions
from .intake import StartGrammar, make_sequence
from .rows import decode_rows, prefill_rows
from .sequence import PrefillPlan, Sampled, Sequence, SequenceStatus, StepCounters

log = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, bm: BlockManager, config: EngineConfig = EngineConfig(), *, eos_token_ids: Seq[int] = (),
                 settle: Callable[[], None] = lambda: None, session_files=None,
                 start_grammar: Optional[StartGrammar] = None):
        self.bm = bm
        self.eos_token_ids = frozenset(eos_token_ids)  # a sequence's stop ids unless its spec names its own
        self.start_grammar = start_grammar
        self.block_size = bm.block_size
        self.config = config
        self.settle = settle
        self.counters = StepCounters()
        self.forks = Forks(bm, self.counters)
        self.hot_sessions = HotSessions(bm, session_files, self.counters)
        self.waiting: list[Sequence] = []
        self.running: dict[str, Sequence] = {}
        self.live: dict[str, Sequence] = {}  # every waiting or running sequence by uid
        self._arrivals = itertools.count()
        self._events: list[TokenEvent] = []
        self._preempted: list[Preempted] = []

    # ================================================================ the engine API
    def add(self, specs: list[SeqSpec]) -> None:
        pool_tokens = (self.bm.num_blocks - self.config.decode_reserve_blocks) * self.block_size
        for spec in specs:
            seq, why = make_sequence(spec, self._arrivals, pool_tokens, self.start_grammar)
            if seq is None:
                self.refuse(spec.uid, why)
                continue
            self.waiting.append(seq)
            self.live[seq.uid] = seq
            self.forks.join(seq)
        self.waiting.sort(key=Sequence.rank)

    def refuse(self, uid: str, why: str) -> None:
        """A spec that cannot run ends at once with "error" (its event goes out with the next step)."""
        self._events.append(TokenEvent(uid, None, "error", error=why))

    def remove(self, uids: list[str]) -> None:
        """Drop these sequences; a job id also drops its samples (``job_id#i``)."""
        gone = set(uids).union(*(self.forks.samples_of(uid) for uid in uids))
        self.waiting = [s for s in self.waiting if s.uid not in gone]
        for uid in gone:
            seq = self.live.get(uid)
            if seq is not None:
                self._unregister(seq)
            seq = self.running.pop(uid, None)
            if seq is not None:
                self._release(seq)

    def has_work(self) -> bool:
        # a launched decode matters only for sequences still running; events not taken yet (a
        # sequence refused at add) go out with the next step
        return bool(self.waiting or self.running or self._events)

    def take_output(self) -> tuple[list[TokenEvent], list[Preempted]]:
        """This step's token events and preempted sequences (and start afresh)."""
        out = self._events, self._preempted
        self._events, self._preempted = [], []
        return out

    # ================================================================ prefill
    def schedule_prefill(self) -> Optional[PrefillPlan]:
        """Start a step: admit what fits, then the prefill pass's rows (None: no prefill)."""
        self.counters.steps += 1
        self._admit()
        copies = self.forks.take_copies()
        n_decoding = sum(1 for s in self.running.values() if s.status is SequenceStatus.DECODE)
        rows = prefill_rows(self.running.values(), self.config, max(1, self.config.step_token_budget - n_decoding))
        if not (rows or copies):
            return None
        plan = PrefillPlan(rows, copies)
        plan.firsts = self.forks.firsts(plan.ending_seqs(), self.waiting)
        return plan

    def postprocess_prefill(self, plan: PrefillPlan, sampled: list[Sampled]) -> None:
        """The pass computed its chunks; ``sampled`` has the first token of each ending row."""
        if plan.rows:
            self.counters.prefill_passes += 1
        self.counters.prefill_tokens += sum(n for _, n in plan.rows)
        for seq, n in plan.rows:
            seq.num_computed += n
            seq.commit_computed(self.bm)
        firsts = {id(w) for w, _ in plan.firsts}
        for s in sampled:
            # a waiting fork's first token, drawn from its sibling's logits: it admits next step
            # sharing the whole prompt and decodes from that token (or it ended there)
            if id(s.seq) not in firsts:
                s.seq.status = SequenceStatus.DECODE
            elif self.live.get(s.seq.uid) is not s.seq:
                continue  # removed meanwhile
            if s.error is not None:
                self.fail(s.seq, s.error)
            else:
                self._emit(s)

    # ================================================================ decode
    def schedule_decode(self, skip: Seq[Sequence] = ()) -> list[Sequence]:
        """The decode rows of this step (``skip``: just prefilled), each with a slot for its token.
        Short of blocks, the pending tokens are read first (finished rows free theirs), then
        sessions are spilled or sequences preempted row by row."""
        rows = decode_rows(self.running.values(), skip)
        if sum(1 for s in rows if self._needs_block(s)) <= self.bm.num_unreferenced:
            for seq in rows:
                if self._needs_block(seq):
                    seq.block_table.append(self.bm.append_block())
            return rows
        self.settle()
        ready = [seq for seq in decode_rows(self.running.values(), skip)
                 if self.running.get(seq.uid) is seq and self._ensure_slot(seq)]
        return [s for s in ready if self.running.get(s.uid) is s]

    def postprocess_decode(self, launched: list[Sequence], collected: list[Sampled]) -> None:
        """``launched`` rows now have a token in flight; ``collected`` are the previous launch's."""
        if launched:
            self.counters.decode_passes += 1
            self.counters.decode_tokens += len(launched)
        for s in launched:
            s.num_computed += 1
            s.pending += 1
        self.collect(collected)

    def collect(self, sampled: list[Sampled]) -> None:
        """Hand out the tokens of a launched decode, now read back."""
        for s in sampled:
            if self.running.get(s.seq.uid) is not s.seq:
                continue  # removed, finished or preempted since the launch: a wasted row
            s.seq.pending -= 1
            self._emit(s)

    # ================================================================ speculative decoding
    def postprocess_verify(self, rows: list[Sequence], drafts: list[list[int]],
                           sampled: list[list[Sampled]]) -> None:
        """A verify pass's tokens (``ModelRunner.verify``: each row's accepted proposal tokens and the
        one after them) are emitted; the positions past them are given back at once (the blocks
        beyond them released: the prefix cache only ever commits emitted tokens' blocks)."""
        self.counters.decode_passes += 1
        self.counters.verify_passes += 1
        for seq, draft, samples in zip(rows, drafts, sampled):
            n = len(samples)
            self.counters.decode_tokens += 1 + len(draft)
            seq.num_computed += n  # positions whose input was its last token or an accepted proposal
            self.bm.shrink_table(seq.block_table, seq.num_computed)
            if draft:
                seq.drafting.verdict(len(draft), n - 1, self.config.speculate_k)
                self.counters.draft_proposed += len(draft)
                self.counters.draft_accepted += n - 1
            first = len(self._events)
            for s in samples:
                if s.token is None:
                    self.fail(seq, s.error)
                elif self.running.get(seq.uid) is seq:
                    self._emit(s)
                if self.running.get(seq.uid) is not seq:
                    break
            if draft and len(self._events) > first:
                self._events[first].draft_proposed, self._events[first].draft_accepted = len(draft), n - 1

    def fail(self, seq: Sequence, error: str) -> None:
        """End a sequence still in the engine (running, or a waiting fork given its first token) with
        "error" (its constraint dead-ended), no token emitted."""
        if self.live.get(seq.uid) is not seq:
            return
        log.warning("%s: %s", seq.uid, error)
        self._events.append(TokenEvent(seq.uid, None, "error", cached_tokens=seq.prefix_hit, error=error))
        self._finish(seq)

    def is_running(self, seq: Sequence) -> bool:
        return self.running.get(seq.uid) is seq

    # ================================================================ admission and preemption
    def _admit(self) -> None:
        cfg = self.config
        while True:
            # most urgent first; a sample waiting for its sibling's prefill lets the next one by
            seq = next((s for s in self.waiting if not self.forks.held(s, self.live)), None)
            if seq is None:
                return
            if cfg.max_batch is not None and len(self.running) >= cfg.max_batch:
                if not self._preempt_for(seq):
                    return
                continue
            if self._try_allocate(seq):
                self.waiting.remove(seq)
                self.running[seq.uid] = seq
                continue
            if self.hot_sessions.spill_one():
                continue
            if not self._preempt_for(seq):
                return

    def _try_allocate(self, seq: Sequence) -> bool:
        """Give ``seq`` its blocks if the pool stays under the pressure threshold, reusing what it
        can: its sibling's (a forked sample), else prefix-cache hits (its session restored first)."""
        bm, cfg = self.bm, self.config
        n = len(seq.tokens)
        sibling = self.forks.source(seq, self.running)
        if sibling is not None:
            hit, computed = self.forks.hit(seq, sibling)
        else:
            # an embedding computes every position (its pooling may need each one's hidden state)
            hit = self.hot_sessions.prefix_hit(seq) if cfg.prefix_cache and seq.spec.embed is None else PrefixHit()
            computed = hit.num_blocks * self.block_size
        new_blocks = bm.blocks_needed(n) - hit.num_blocks
        revived = sum(1 for b in hit.block_ids if bm.blocks[b].ref_count == 0)
        used_after = bm.num_used + revived + new_blocks + cfg.decode_reserve_blocks
        limit = bm.num_blocks if not self.running else cfg.pressure * bm.num_blocks
        if used_after > limit or not bm.can_allocate(new_blocks + cfg.decode_reserve_blocks, hit):
            return False
        seq.place(bm.allocate(new_blocks, hit), hit.hashes, computed)
        if sibling is None:
            seq.prefix_hit = computed
            self.counters.prefix_hit_tokens += computed
            self.counters.prompt_tokens += n
        else:
            self.forks.admitted(seq, sibling, hit.num_blocks)
        log.debug("admit %s: %d tokens, %d computed, %d new blocks", seq.uid, n, computed, new_blocks)
        return True

    def victim(self) -> Sequence:
        """The running sequence preempted first: the least urgent, newest."""
        return max(self.running.values(), key=Sequence.rank)

    def _preempt_for(self, waiting: Sequence) -> bool:
        """Preempt a running sequence far enough below ``waiting`` in priority."""
        if not self.running:
            return False
        victim = self.victim()
        # ranked strictly after it too: with priority_gap 0, two sequences of one priority (the n
        # samples of a job, two jobs of one score) would preempt each other at every step, for ever
        if victim.spec.priority - waiting.spec.priority < self.config.priority_gap or victim.rank() <= waiting.rank():
            return False
        self._preempt(victim)
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.settle()  # the victim's pending token belongs in its Preempted record
        if self.running.get(seq.uid) is not seq:
            return  # it finished while settling
        log.info("preempt %s (priority %s) after %d tokens", seq.uid, seq.spec.priority, len(seq.generated))
        del self.running[seq.uid]
        self._unregister(seq)
        self._release(seq)
        self.counters.preemptions += 1
        self._preempted.append(Preempted(seq.uid, list(seq.generated)))

    def _needs_block(self, seq: Sequence) -> bool:
        return seq.num_computed >= len(seq.block_table) * self.block_size

    def _ensure_slot(self, seq: Sequence) -> bool:
        """Give ``seq`` a block for its next token, preempting if the pool is full."""
        while self._needs_block(seq):
            if self.bm.can_append():
                seq.block_table.append(self.bm.append_block())
                return True
            if self.hot_sessions.spill_one():
                continue
            # Never the only sequence: add() keeps each one within the pool.
            victim = self.victim()
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    # ================================================================ tokens and ends
    def _emit(self, s: Sampled) -> None:
        seq = s.seq
        if s.embedding is not None:  # an embedding's prefill ended: its vector ends it (nothing is generated)
            self._events.append(TokenEvent(seq.uid, None, "stop", cached_tokens=0, embedding=s.embedding))
            return self._finish(seq)
        refused = seq.grammar.advance(s.token) if seq.grammar is not None else None
        if refused:
            return self.fail(seq, refused)
        reason = seq.append_token(s.token, self.eos_token_ids)
        seq.commit_computed(self.bm)
        self._events.append(TokenEvent(seq.uid, s.token, reason, s.logprobs, cached_tokens=seq.prefix_hit))
        if reason is not None:
            self._finish(seq)

    def _finish(self, seq: Sequence) -> None:
        if seq.status is SequenceStatus.WAITING:  # a fork that ended on its first token
            self.waiting.remove(seq)
        self.running.pop(seq.uid, None)
        self._unregister(seq)
        if seq.spec.session_id and self.config.prefix_cache:  # (without it, the next turn would not use them)
            self.hot_sessions.keep(seq)
        self._release(seq)

    def _release(self, seq: Sequence) -> None:
        self.forks.drop_copies(seq)
        if seq.block_table:
            self.bm.deallocate(seq.block_table)
        seq.release()

    def _unregister(self, seq: Sequence) -> None:
        """The sequence left the engine (finished, removed, preempted)."""
        if self.live.get(seq.uid) is seq:
            del self.live[seq.uid]
            self.forks.leave(seq)
