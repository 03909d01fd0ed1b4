"""The paged-KV generation engine (implements ``mlxq.worker.engine_api.Engine``).

Each ``step()``:

1. admits queued sequences while their prompt blocks (minus prefix-cache hits)
   plus a decode reserve fit under the pressure threshold, spilling hot
   sessions and preempting much-lower-priority sequences when needed;
2. prefills the prompt chunks of several sequences in one ragged forward pass
   (bounded token budget, chunk size by cache position), emitting the first
   token of each sequence whose prefill ends;
3. launches one batched decode forward over every other running sequence
   (first giving each a block for its new token, preempting the
   lowest-priority, newest sequence when the pool is exhausted), then reads the
   tokens of the *previous* decode launch while this one computes.

Step 3 is mlx-lm's ``generate_step`` pipelining, for any batch size: a row's
input is the previous step's sampled token, still lazy, and ``mx.async_eval``
starts the next forward before the host hands out token n.  A row that turns
out to have finished wastes one speculative row; its write lands in its own
(released) block's free slot, ordered before any later owner's writes by the
pool arrays' data dependencies.  Whenever a sequence must be preempted the
engine first reads the pending tokens ("settles"), so a preempted job carries
every token it generated.

Policy lives here; every tensor operation is in ``model_runner`` and ``cache``.
All KV lives in ``KVPool``; ``BlockManager`` does the bookkeeping; the stock
mlx-lm model runs over ``PagedLayerCache`` objects.
"""

from __future__ import annotations

import enum
import itertools
import logging
from dataclasses import dataclass, field, replace
from typing import Optional, Sequence

import mlx.core as mx

from ..engine_api import Preempted, SeqSpec, TokenEvent
from .attention import use_attention
from .block_manager import BLOCK_SIZE, BlockManager, PrefixHit
from .kv_cache import BatchRow, KVPool, probe_kv_shape
from .model_runner import ModelRunner, SampleRow
from .sessions import HotSession, SessionStore

log = logging.getLogger(__name__)

# (cache position below which, chunk size); the 4096/2048/1024/512
# scaled down 8x for a CPU.
DEFAULT_CHUNK_SCHEDULE = ((2048, 512), (8192, 256), (20480, 128), (None, 64))
DEFAULT_BUDGET_BYTES = 512 * 1024 * 1024


class SeqState(enum.Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass
class _Seq:
    spec: SeqSpec
    arrival: int
    tokens: list[int]  # prompt + resume tokens + tokens generated this run
    num_context: int  # len(prompt) + len(resume_tokens)
    state: SeqState = SeqState.WAITING
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # committed full blocks
    num_computed: int = 0  # tokens whose KV is in the pool
    emitted: int = 0  # tokens emitted this run
    session_checked: bool = False  # warm session file looked at already
    prefix_hit: int = 0  # prompt tokens found in the prefix cache at the last admission (reported per job)
    pending: int = 0  # tokens sampled by a launched decode, not yet read (0 or 1)

    @property
    def uid(self) -> str:
        return self.spec.uid

    @property
    def generated(self) -> list[int]:
        """Everything generated for this job, earlier runs included."""
        return self.tokens[len(self.spec.prompt):]

    def victim_key(self):
        # The preemption victim is the max: lowest priority, then newest.
        return (self.spec.priority, self.arrival)


@dataclass
class _InFlight:
    """A launched decode whose tokens have not been read yet."""

    seqs: list[_Seq]
    toks: mx.array  # (B,) lazy
    logprobs: list  # per row: lazy (vocab,) or None


@dataclass
class StepCounters:
    prefix_hit_tokens: int = 0
    prompt_tokens: int = 0
    preemptions: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    session_spills: int = 0
    session_restores: int = 0
    steps: int = 0
    prefill_passes: int = 0
    decode_passes: int = 0


class PagedEngine:
    def __init__(
        self,
        model,
        *,
        memory_budget_bytes: Optional[int] = None,
        num_blocks: Optional[int] = None,
        max_batch: Optional[int] = None,
        pressure: float = 0.85,
        eos_token_ids: Sequence[int] = (),
        model_id: str = "",
        session_dir: Optional[str] = None,
        prefix_cache: bool = True,
        chunked_prefill: bool = True,
        chunk_schedule=DEFAULT_CHUNK_SCHEDULE,
        step_token_budget: int = 512,
        decode_reserve_blocks: int = 1,
        priority_gap: float = 1.0,
        max_sequences: int = 256,
        max_waiting: int = 8,
        block_size: int = BLOCK_SIZE,
        context_length: Optional[int] = None,
        attention: Optional[str] = None,
    ):
        self.model = model
        self.block_size = block_size
        self.kv_shape = probe_kv_shape(model)
        per_block = self.kv_shape.bytes_per_block(block_size)
        if num_blocks is None:
            budget = memory_budget_bytes or DEFAULT_BUDGET_BYTES
            num_blocks = budget // per_block
            if memory_budget_bytes is None and context_length:
                # the default budget never exceeds what max_sequences full contexts need
                num_blocks = min(num_blocks, (max_batch or max_sequences) * -(-context_length // block_size))
        if num_blocks < 2:
            raise ValueError(f"memory budget too small: {per_block} bytes per block")
        self.bm = BlockManager(num_blocks, block_size, model_id)
        self.pool = KVPool(self.kv_shape, num_blocks, block_size, dtype=self.kv_shape.dtype)
        self.runner = ModelRunner(model, self.pool)
        # auto / fused / gather (None: $MLXQ_ATTENTION, else auto); logs its choice
        self.attention = use_attention(model, self.pool, attention)
        self.max_batch = max_batch
        self.pressure = pressure
        self.eos_token_ids = set(eos_token_ids)
        self.model_id = model_id
        self.prefix_cache = prefix_cache
        self.chunked_prefill = chunked_prefill
        self.chunk_schedule = chunk_schedule
        self.step_token_budget = step_token_budget
        self.decode_reserve_blocks = decode_reserve_blocks
        self.priority_gap = priority_gap
        self.max_sequences = max_sequences
        self.max_waiting = max_waiting
        self.sessions = SessionStore(session_dir, model_id)
        self.counters = StepCounters()
        self._arrivals = itertools.count()
        self._waiting: list[_Seq] = []
        self._active: dict[str, _Seq] = {}
        self._inflight: Optional[_InFlight] = None
        self._events: list[TokenEvent] = []
        self._preempted: list[Preempted] = []
        log.info("paged engine: %d blocks of %d tokens, %.1f MiB %s pool",
                 num_blocks, block_size, self.pool.nbytes / 2**20, self.pool.dtype)

    # ================================================================ Engine API
    def add(self, specs: list[SeqSpec]) -> None:
        for spec in specs:
            if not spec.prompt:
                raise ValueError(f"{spec.uid}: empty prompt")
            ctx = list(spec.prompt) + list(spec.resume_tokens)
            fits = (self.bm.num_blocks - self.decode_reserve_blocks) * self.block_size
            if len(ctx) + spec.max_tokens > fits:
                # Alone it would exhaust the pool mid-decode: finish it with
                # "length" where the pool ends (the worker should have asked
                # can_admit first).
                log.warning("%s: %d + %d tokens exceed the pool; max_tokens capped",
                            spec.uid, len(ctx), spec.max_tokens)
                spec = replace(spec, max_tokens=max(1, fits - len(ctx)))
            self._waiting.append(_Seq(spec, next(self._arrivals), ctx, len(ctx)))
        self._waiting.sort(key=lambda s: (s.spec.priority, s.arrival))

    def remove(self, uids: list[str]) -> None:
        gone = set(uids)
        self._waiting = [s for s in self._waiting if s.uid not in gone]
        for uid in gone:
            seq = self._active.pop(uid, None)
            if seq is not None:
                self._release(seq)

    def has_work(self) -> bool:
        # a launched decode matters only for sequences still active
        return bool(self._waiting or self._active)

    def free_slots(self) -> int:
        """Keep pulling while up to ``max_waiting`` jobs wait here for memory.

        Jobs waiting inside the engine are admitted (in priority order) the
        moment blocks free up, and a more urgent one preempts at once; beyond
        the bound the rest stay in Redis for other workers.
        """
        n_seqs = len(self._waiting) + len(self._active)
        if self.max_batch is not None:
            return max(0, self.max_batch - n_seqs)
        if n_seqs >= self.max_sequences or len(self._waiting) >= self.max_waiting:
            return 0
        headroom = int(self.pressure * self.bm.num_blocks) - self.bm.num_used
        # At least one: a more urgent job may need to reach us to preempt.
        # as many as fit now (about 4 blocks each), plus up to max_waiting that wait here
        return max(1, min(self.max_sequences - n_seqs,
                          max(0, headroom // 4) + self.max_waiting - len(self._waiting)))

    def urgent_below(self) -> float:
        """A queued job with a priority below this would preempt someone here now.

        The worker's fetcher peeks at the head of the Redis queue while the
        engine has no free slot and pulls such a job at once.  -inf when none
        would (nothing running, or a waiting job already outranks it).
        """
        if not self._active:
            return float("-inf")
        victim = max(self._active.values(), key=_Seq.victim_key)
        threshold = victim.spec.priority - self.priority_gap
        if any(w.spec.priority <= threshold for w in self._waiting):
            return float("-inf")  # one already waits to preempt: it goes first
        return threshold

    def can_admit(self, prompt_len: int, max_tokens: int) -> bool:
        need = self.bm.blocks_needed(prompt_len + max(1, max_tokens))
        return need + self.decode_reserve_blocks <= self.bm.num_blocks

    def stats(self) -> dict:
        c = self.bm.counts()
        return {
            "blocks_total": c.total,
            "blocks_used": c.used,
            "blocks_cached": c.cached,
            "blocks_free": c.free,
            "prefix_hit_tokens": self.counters.prefix_hit_tokens,
            "prompt_tokens": self.counters.prompt_tokens,
            "preemptions": self.counters.preemptions,
            "evictions": self.bm.evictions,
            "running": len(self._active),
            "waiting": len(self._waiting),
            "sessions_hot": len(self.sessions.hot),
            "session_spills": self.counters.session_spills,
            "session_restores": self.counters.session_restores,
            "engine_steps": self.counters.steps,
            "prefill_passes": self.counters.prefill_passes,
            "decode_passes": self.counters.decode_passes,
        }

    def step(self) -> tuple[list[TokenEvent], list[Preempted]]:
        self._events, self._preempted = [], []
        self.counters.steps += 1
        self._admit()
        budget = self.step_token_budget - sum(
            1 for s in self._active.values() if s.state is SeqState.DECODE)
        just_prefilled = self._prefill(max(1, budget))
        self._decode(just_prefilled)
        events, preempted = self._events, self._preempted
        self._events, self._preempted = [], []
        return events, preempted

    def close(self) -> None:
        """Spill every hot session to disk (when a session dir is set)."""
        self._settle()
        while self.sessions.hot:
            self._spill_one_session()

    # ================================================================ admission
    def _admit(self) -> None:
        while self._waiting:
            if self.max_batch is not None and len(self._active) >= self.max_batch:
                if not self._preempt_for(self._waiting[0]):
                    return
                continue
            seq = self._waiting[0]
            if self._try_allocate(seq):
                self._waiting.pop(0)
                self._active[seq.uid] = seq
                continue
            if self._spill_one_session():
                continue
            if not self._preempt_for(seq):
                return

    def _try_allocate(self, seq: _Seq) -> bool:
        bm = self.bm
        n = len(seq.tokens)
        if seq.spec.session_id and not seq.session_checked:
            seq.session_checked = True
            self._restore_session(seq)
        hit = PrefixHit()
        if self.prefix_cache:
            hit = bm.lookup(seq.tokens, n - 1)
        new_blocks = bm.blocks_needed(n) - hit.num_blocks
        revived = sum(1 for b in hit.block_ids if bm.blocks[b].ref_count == 0)
        used_after = bm.num_used + revived + new_blocks + self.decode_reserve_blocks
        limit = bm.num_blocks if not self._active else self.pressure * bm.num_blocks
        if used_after > limit or not bm.can_allocate(new_blocks + self.decode_reserve_blocks, hit):
            return False
        seq.block_table = bm.allocate(new_blocks, hit)
        seq.block_hashes = list(hit.hashes)
        seq.num_computed = hit.num_blocks * self.block_size
        seq.prefix_hit = seq.num_computed
        seq.state = SeqState.PREFILL
        self.counters.prefix_hit_tokens += seq.num_computed
        self.counters.prompt_tokens += n
        log.debug("admit %s: %d tokens, %d hit, %d new blocks",
                  seq.uid, n, seq.num_computed, new_blocks)
        return True

    def _preempt_for(self, waiting: _Seq) -> bool:
        """Preempt a running sequence far enough below ``waiting`` in priority."""
        if not self._active:
            return False
        victim = max(self._active.values(), key=_Seq.victim_key)
        if victim.spec.priority - waiting.spec.priority < self.priority_gap:
            return False
        self._preempt(victim)
        return True

    def _preempt(self, seq: _Seq) -> None:
        self._settle()  # the victim's pending token belongs in its Preempted record
        if self._active.get(seq.uid) is not seq:
            return  # it finished while settling
        log.info("preempt %s (priority %s) after %d tokens",
                 seq.uid, seq.spec.priority, len(seq.generated))
        del self._active[seq.uid]
        self._release(seq)
        self.counters.preemptions += 1
        self._preempted.append(Preempted(seq.uid, list(seq.generated)))

    # ================================================================ prefill
    def _chunk_size(self, pos: int) -> int:
        for limit, size in self.chunk_schedule:
            if limit is None or pos < limit:
                return size
        return self.chunk_schedule[-1][1]

    def _pick_prefill(self, budget: int) -> list[tuple[_Seq, int]]:
        """The rows of one ragged prefill pass: (sequence, tokens this pass).

        Most urgent first, within the token budget; padded size (rows x the
        longest chunk) stays within the budget too, so a long chunk does not
        drag many short rows' padding along.
        """
        todo = sorted((s for s in self._active.values() if s.state is SeqState.PREFILL),
                      key=lambda s: (s.spec.priority, s.arrival))
        picked: list[tuple[_Seq, int]] = []
        width = 0
        left = budget
        for seq in todo:
            if left <= 0:
                break
            remaining = len(seq.tokens) - seq.num_computed
            if self.chunked_prefill:
                n = min(remaining, self._chunk_size(seq.num_computed), left)
            else:
                n = remaining
            if picked and max(width, n) * (len(picked) + 1) > budget:
                break
            picked.append((seq, n))
            width = max(width, n)
            left -= n
        return picked

    def _prefill(self, budget: int) -> set[str]:
        picked = self._pick_prefill(budget)
        if not picked:
            return set()
        width = max(n for _, n in picked)
        rows = [BatchRow(seq.block_table, seq.num_computed, n) for seq, n in picked]
        inputs = mx.array([seq.tokens[seq.num_computed:seq.num_computed + n] + [0] * (width - n)
                           for seq, n in picked])
        ragged = any(n != width for _, n in picked)
        last = mx.array([n - 1 for _, n in picked]) if ragged else None
        ending = [i for i, (seq, n) in enumerate(picked)
                  if seq.num_computed + n >= len(seq.tokens)]
        logits = self.runner.forward(rows, inputs, last, keep=ending)
        self.counters.prefill_passes += 1
        self.counters.prefill_tokens += sum(n for _, n in picked)
        toks = lps = None
        if ending:
            toks, lps = self.runner.sample(logits, [self._sample_row(picked[i][0]) for i in ending])
            mx.eval(toks, [x for x in lps if x is not None], self.pool.arrays())
            toks = toks.tolist()
        else:
            mx.eval(self.pool.arrays())
        del logits
        done: set[str] = set()
        for seq, n in picked:
            seq.num_computed += n
            self._commit_full_blocks(seq)
        for j, i in enumerate(ending):
            seq = picked[i][0]
            seq.state = SeqState.DECODE
            done.add(seq.uid)
            self._emit(seq, toks[j], lps[j])
        return done

    # ================================================================ decode
    def _decode(self, skip: set[str]) -> None:
        """Launch this step's decode, then read the previous launch's tokens."""
        prev = self._inflight
        self._inflight = None
        rows = self._decode_rows(skip)
        if not rows:
            if prev is not None:
                self._collect(prev)
            return
        if sum(1 for s in rows if self._needs_block(s)) > self.bm.num_unreferenced:
            # Not enough free blocks: read pending tokens first (finished rows
            # free theirs), then spill sessions or preempt row by row.
            if prev is not None:
                self._collect(prev)
                prev = None
            ready = []
            for seq in self._decode_rows(skip):
                if self._active.get(seq.uid) is seq and self._ensure_slot(seq):
                    ready.append(seq)
            rows = [s for s in ready if self._active.get(s.uid) is s]
            if not rows:
                return
        else:
            for seq in rows:
                if self._needs_block(seq):
                    seq.block_table.append(self.bm.append_block())
        # rows with a pending token feed it straight from the previous launch
        rows.sort(key=lambda s: not s.pending)
        n_pending = sum(1 for s in rows if s.pending)
        parts = []
        if n_pending:
            where = {id(s): i for i, s in enumerate(prev.seqs)}
            idx = [where[id(s)] for s in rows[:n_pending]]
            prev_toks = prev.toks.astype(mx.int32)
            parts.append(prev_toks if idx == list(range(len(prev.seqs))) else prev_toks[mx.array(idx)])
        if n_pending < len(rows):
            parts.append(mx.array([s.tokens[-1] for s in rows[n_pending:]], dtype=mx.int32))
        inputs = (parts[0] if len(parts) == 1 else mx.concatenate(parts))[:, None]
        batch = [BatchRow(s.block_table, s.num_computed, 1) for s in rows]
        logits = self.runner.forward(batch, inputs)
        sample_rows = []
        for i, s in enumerate(rows):
            extra = prev_toks[where[id(s)]:where[id(s)] + 1] if (s.pending and s.spec.logits_processors) else None
            sample_rows.append(self._sample_row(s, extra))
        toks, lps = self.runner.sample(logits, sample_rows)
        mx.async_eval(toks, [x for x in lps if x is not None])
        for s in rows:
            s.num_computed += 1
            s.pending += 1
        self._inflight = _InFlight(rows, toks, lps)
        self.counters.decode_passes += 1
        self.counters.decode_tokens += len(rows)
        if prev is not None:
            self._collect(prev)

    def _decode_rows(self, skip: set[str]) -> list[_Seq]:
        # a row whose pending token is its last (max_tokens) needs no launch
        rows = [s for s in self._active.values()
                if s.state is SeqState.DECODE and s.uid not in skip
                and s.emitted + s.pending < s.spec.max_tokens]
        rows.sort(key=lambda s: (s.spec.priority, s.arrival))
        return rows

    def _needs_block(self, seq: _Seq) -> bool:
        return seq.num_computed >= len(seq.block_table) * self.block_size

    def _ensure_slot(self, seq: _Seq) -> bool:
        """Give ``seq`` a block for its next token, preempting if the pool is full."""
        while self._needs_block(seq):
            if self.bm.can_append():
                seq.block_table.append(self.bm.append_block())
                return True
            if self._spill_one_session():
                continue
            # Never the only sequence: add() keeps each one within the pool.
            victim = max(self._active.values(), key=_Seq.victim_key)
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _collect(self, fl: _InFlight) -> None:
        """Read a launched decode's tokens and hand them out."""
        toks = fl.toks.tolist()
        for seq, tok, lp in zip(fl.seqs, toks, fl.logprobs):
            if self._active.get(seq.uid) is not seq:
                continue  # removed, finished or preempted since the launch: a wasted row
            seq.pending -= 1
            self._emit(seq, tok, lp)

    def _settle(self) -> None:
        """Read the pending tokens now (before preempting or spilling)."""
        if self._inflight is not None:
            fl, self._inflight = self._inflight, None
            self._collect(fl)

    # ================================================================ helpers
    def _sample_row(self, seq: _Seq, pending_tok: Optional[mx.array] = None) -> SampleRow:
        spec = seq.spec
        ctx = None
        if spec.logits_processors:
            ctx = mx.array(seq.tokens)
            if pending_tok is not None:
                ctx = mx.concatenate([ctx, pending_tok])
        return SampleRow(spec.sampler, spec.logits_processors, ctx, spec.want_logprobs)

    def _commit_full_blocks(self, seq: _Seq) -> None:
        """Register blocks whose every token is computed and known."""
        bs = self.block_size
        n_full = min(seq.num_computed, len(seq.tokens)) // bs
        while len(seq.block_hashes) < n_full:
            i = len(seq.block_hashes)
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            h = self.bm.commit(seq.block_table[i], parent, seq.tokens[i * bs:(i + 1) * bs])
            seq.block_hashes.append(h)

    def _emit(self, seq: _Seq, tok: int, logprobs) -> None:
        seq.tokens.append(tok)
        seq.emitted += 1
        self._commit_full_blocks(seq)
        reason = None
        stops = self.eos_token_ids if seq.spec.stop_token_ids is None else seq.spec.stop_token_ids
        if tok in stops:
            reason = "stop"
        elif seq.emitted >= seq.spec.max_tokens:
            reason = "length"
        self._events.append(TokenEvent(seq.uid, tok, reason, logprobs, cached_tokens=seq.prefix_hit))
        if reason is not None:
            self._finish(seq)

    def _finish(self, seq: _Seq) -> None:
        self._active.pop(seq.uid, None)
        if seq.spec.session_id:
            self._keep_session(seq)
        self._release(seq)

    def _release(self, seq: _Seq) -> None:
        if seq.block_table:
            self.bm.deallocate(seq.block_table)
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed = 0
        seq.pending = 0
        seq.state = SeqState.WAITING

    # ================================================================ sessions
    def _keep_session(self, seq: _Seq) -> None:
        n_full = len(seq.block_hashes)
        if n_full == 0:
            return
        blocks = seq.block_table[:n_full]
        self.bm.ref(blocks)
        hot = HotSession(seq.spec.session_id, blocks, seq.tokens[:n_full * self.block_size])
        old = self.sessions.put_hot(hot)
        if old is not None:
            self.bm.deallocate(old.block_ids)

    def _spill_one_session(self) -> bool:
        """Write the least recently used hot session to disk and unpin it."""
        hot = self.sessions.oldest_hot()
        if hot is None:
            return False
        del self.sessions.hot[hot.session_id]
        if self.sessions.session_dir:
            self.sessions.save(hot, self.pool.read_blocks(hot.block_ids))
        self.bm.deallocate(hot.block_ids)
        self.counters.session_spills += 1
        return True

    def _restore_session(self, seq: _Seq) -> None:
        """Load a warm session's blocks into the prefix cache when they help."""
        sid = seq.spec.session_id
        if sid in self.sessions.hot:
            self.sessions.touch(sid)
            return
        bs = self.block_size
        warm = self.sessions.load(sid) if self.sessions.session_dir else None
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
        new_ids = table[hit.num_blocks:]
        lo, hi = hit.num_blocks * bs, n_blocks * bs
        self.pool.write_blocks(new_ids, {k: v[:, lo:hi] for k, v in warm.data.items()})
        parent = hit.hashes[-1] if hit.hashes else None
        for i, bid in enumerate(new_ids, start=hit.num_blocks):
            parent = self.bm.commit(bid, parent, seq.tokens[i * bs:(i + 1) * bs])
        self.bm.deallocate(table)  # now cached; the lookup that follows takes them
        self.counters.session_restores += 1
        log.debug("session %s restored: %d of %d blocks from disk", sid, need, n_blocks)
