"""The engine's tensor side: plans become arrays, forward passes over the pool, sampled tokens.

The scheduler decides which rows run; this module turns a prefill plan into one
ragged forward pass (evaluated, with its sampled tokens read back) and decode rows
into one batched forward pass that runs while the host hands out the previous
step's tokens.  It owns every ``mx.eval`` / ``mx.async_eval`` of a step.

The decode is mlx-lm's ``generate_step`` pipelining, for any batch size: a row's
input is the previous launch's sampled token, still lazy, and ``mx.async_eval``
starts the next forward before the host reads token n.  A row that turns out to
have finished wastes one speculative row; its write lands in its own (released)
block's free slot, ordered before any later owner's writes by the pool arrays'
data dependencies.  ``take_inflight`` reads the pending tokens at once (the
scheduler's ``settle``: before a preemption, or when the pool runs short mid-decode).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import mlx.core as mx

from .kv_cache import BatchRow, BatchView, KVPool, make_layer_caches
from .sampler import SampleRow, sample
from .scheduler import PrefillPlan
from .sequence import Sampled, Sequence


@dataclass
class _InFlight:
    """A launched decode whose tokens have not been read yet."""

    seqs: list[Sequence]
    toks: mx.array  # (B,) lazy
    logprobs: list  # per row: lazy (vocab,) or None


# Model files whose ``__call__`` is exactly ``self.model(...)`` then the tied
# embedding or ``lm_head``: for them the vocabulary projection runs only on the
# rows and positions that are sampled (a prefill chunk needs one position of
# its last chunk, not all of them).  Others run unchanged.
_SPLIT_HEAD_MODULES = {"mlx_lm.models.llama", "mlx_lm.models.qwen2", "mlx_lm.models.qwen3"}


class ModelRunner:
    def __init__(self, model, pool: KVPool):
        self.model = model
        self.pool = pool
        self.split_head = (type(model).__module__ in _SPLIT_HEAD_MODULES and hasattr(model, "model")
                           and hasattr(model, "args"))
        self._inflight: Optional[_InFlight] = None

    def _head(self, h: mx.array) -> mx.array:
        if self.model.args.tie_word_embeddings:
            return self.model.model.embed_tokens.as_linear(h)
        return self.model.lm_head(h)

    def forward(self, rows: list[BatchRow], inputs: mx.array, last_index: Optional[mx.array] = None,
                keep: Optional[list[int]] = None):
        """Run ``inputs`` (B, N) over the pool; logits of each row's last real token.

        ``last_index``: (B,) index of each row's last real input (ragged rows);
        None: the last column.  ``keep``: only these rows' logits (default all).
        Returns (len(keep), V), or None when ``keep`` is empty (the pass only
        writes K/V into the pool).
        """
        view = BatchView(rows, self.pool.block_size, self.pool.scratch_block)
        caches = make_layer_caches(self.pool, view)
        if keep is not None and not keep:
            if self.split_head:
                self.model.model(inputs, caches)  # lazy: K/V writes only, evaluated with the pool
            else:
                self.model(inputs, cache=caches)
            return None
        out = self.model.model(inputs, caches) if self.split_head else self.model(inputs, cache=caches)
        if last_index is None:
            out = out[:, -1, :]
        else:
            out = mx.take_along_axis(out, last_index[:, None, None], axis=1)[:, 0, :]
        if keep is not None and len(keep) < len(rows):
            out = out[mx.array(keep)]
        return self._head(out) if self.split_head else out

    # ================================================================ prefill
    def prefill(self, plan: PrefillPlan) -> list[Sampled]:
        """Run one ragged prefill pass (evaluated); the first token of each ending row."""
        width = max(n for _, n in plan.rows)
        rows = [BatchRow(seq.block_table, seq.num_computed, n) for seq, n in plan.rows]
        inputs = mx.array([seq.tokens[seq.num_computed:seq.num_computed + n] + [0] * (width - n)
                           for seq, n in plan.rows])
        ragged = any(n != width for _, n in plan.rows)
        last = mx.array([n - 1 for _, n in plan.rows]) if ragged else None
        logits = self.forward(rows, inputs, last, keep=plan.ending)
        if not plan.ending:
            mx.eval(self.pool.arrays())
            return []
        seqs = plan.ending_seqs()
        toks, lps = sample(logits, [self._sample_row(seq) for seq in seqs])
        mx.eval(toks, [x for x in lps if x is not None], self.pool.arrays())
        return [Sampled(seq, tok, lp) for seq, tok, lp in zip(seqs, toks.tolist(), lps)]

    # ================================================================ decode
    def decode(self, rows: list[Sequence]) -> list[Sampled]:
        """Launch one decode step over ``rows`` (not waited for), then read the previous launch."""
        prev = self._inflight
        self._inflight = self._launch(rows, prev) if rows else None
        return self._read(prev)

    def take_inflight(self) -> list[Sampled]:
        """Read the launched decode's tokens now (nothing stays in flight)."""
        prev, self._inflight = self._inflight, None
        return self._read(prev)

    def _launch(self, rows: list[Sequence], prev: Optional[_InFlight]) -> _InFlight:
        # rows with a pending token feed it straight from the previous launch
        rows = sorted(rows, key=lambda s: not s.pending)
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
        logits = self.forward([BatchRow(s.block_table, s.num_computed, 1) for s in rows], inputs)
        sample_rows = []
        for s in rows:
            i = where[id(s)] if s.pending and s.spec.logits_processors else None
            sample_rows.append(self._sample_row(s, None if i is None else prev_toks[i:i + 1]))
        toks, lps = sample(logits, sample_rows)
        mx.async_eval(toks, [x for x in lps if x is not None])
        return _InFlight(rows, toks, lps)

    @staticmethod
    def _read(fl: Optional[_InFlight]) -> list[Sampled]:
        if fl is None:
            return []
        return [Sampled(seq, tok, lp) for seq, tok, lp in zip(fl.seqs, fl.toks.tolist(), fl.logprobs)]

    @staticmethod
    def _sample_row(seq: Sequence, pending_tok: Optional[mx.array] = None) -> SampleRow:
        spec = seq.spec
        ctx = None
        if spec.logits_processors:
            ctx = mx.array(seq.tokens)
            if pending_tok is not None:
                ctx = mx.concatenate([ctx, pending_tok])
        return SampleRow(spec.sampler, spec.logits_processors, ctx, spec.want_logprobs)
