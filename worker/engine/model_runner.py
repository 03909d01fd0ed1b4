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
import numpy as np

from .api import EmbedSpec
from .kv_cache import BatchRow, BatchView, KVPool, make_layer_caches
from .logit_shaping import GrammarBook, Shaped, shape
from .sampler import REPETITION_CONTEXT, RowSampler, SampleRow, sample
from .sequence import PrefillPlan
from .sequence import Sampled, Sequence


@dataclass
class _InFlight:
    """A launched decode whose tokens have not been read yet."""

    seqs: list[Sequence]
    toks: Optional[mx.array]  # (B,) lazy; None while the launch waits to be sampled
    logprobs: list  # per row: lazy (vocab,) or None
    logits: Optional[mx.array] = None  # a deferred launch's logits (B, vocab), sampled later


# Model files whose ``__call__`` is exactly ``self.model(...)`` then the tied
# embedding or ``lm_head``: for them the vocabulary projection runs only on the
# rows and positions that are sampled (a prefill chunk needs one position of
# its last chunk, not all of them).  Others run unchanged.
_SPLIT_HEAD_MODULES = {"mlx_lm.models.llama", "mlx_lm.models.qwen2", "mlx_lm.models.qwen3"}


class ModelRunner:
    def __init__(self, model, pool: KVPool):
        self.model = model
        self.pool = pool
        self.book: Optional[GrammarBook] = None  # the engine's, once a constrained sequence came
        self.split_head = (type(model).__module__ in _SPLIT_HEAD_MODULES and hasattr(model, "model")
                           and hasattr(model, "args"))
        self._inflight: Optional[_InFlight] = None
        # decode steps straight from the extension's ops where the engine found them to apply
        # (decode_forward.DecodeForward: the same bits, less host work); else the model file
        self.decode_forward = None

    def head(self, h: mx.array) -> mx.array:
        """The vocabulary projection of the model file (its tied embedding or ``lm_head``)."""
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
        out = self.run(rows, inputs)  # lazy: with keep empty, K/V writes only, evaluated with the pool
        if keep is not None and not keep:
            return None
        return self.last_rows(out, last_index, keep)

    def run(self, rows: list[BatchRow], inputs: mx.array) -> mx.array:
        """The model over the pool: its final hidden states (B, N, D) where the head splits off
        (``split_head``), else its logits (B, N, V)."""
        view = BatchView(rows, self.pool.block_size, self.pool.scratch_block)
        caches = make_layer_caches(self.pool, view)
        return self.model.model(inputs, caches) if self.split_head else self.model(inputs, cache=caches)

    def last_rows(self, out: mx.array, last_index: Optional[mx.array] = None,
                  keep: Optional[list[int]] = None) -> mx.array:
        """``run``'s output at each row's last real position (``forward``'s arguments), as logits."""
        rows = out.shape[0]
        if last_index is None:
            out = out[:, -1, :]
        else:
            out = mx.take_along_axis(out, last_index[:, None, None], axis=1)[:, 0, :]
        if keep is not None and keep != list(range(rows)):
            out = out[mx.array(keep)]
        return self.head(out) if self.split_head else out

    # ================================================================ prefill
    def prefill(self, plan: PrefillPlan) -> list[Sampled]:
        """Run one ragged prefill pass (evaluated); the first token of each ending row (a row whose
        grammar allows no first token comes back with ``token`` None and its ``error``).  The plan's
        block copies (forked samples) are made first; the plan's waiting forks (``firsts``) get their
        first token from their sibling's row, each with its own sampler."""
        if plan.copies:
            self._copy_blocks(plan.copies)
        if not plan.rows:
            mx.eval(self.pool.arrays())
            return []
        width = max(n for _, n in plan.rows)
        rows = [BatchRow(seq.block_table, seq.num_computed, n) for seq, n in plan.rows]
        inputs = mx.array([seq.tokens[seq.num_computed:seq.num_computed + n] + [0] * (width - n)
                           for seq, n in plan.rows])
        ragged = any(n != width for _, n in plan.rows)
        last = mx.array([n - 1 for _, n in plan.rows]) if ragged else None
        ending = plan.ending_seqs()
        # the rows sampled: ending rows that generate, then waiting forks from their sibling's row
        gen = [j for j, s in enumerate(ending) if s.spec.embed is None]
        keep = [plan.ending[j] for j in gen] + [plan.ending[k] for _, k in plan.firsts]
        seqs = [ending[j] for j in gen] + [w for w, _ in plan.firsts]
        embedded: list[Sampled] = []
        if any(seq.spec.embed is not None for seq, _ in plan.rows):
            out = self.run(rows, inputs)
            embedded = self._pool(plan, out)
            logits = self.last_rows(out, last, keep) if keep else None
        else:
            logits = self.forward(rows, inputs, last, keep=keep)
        if not seqs:
            mx.eval(self.pool.arrays(), [s.embedding for s in embedded])
            return [self._vector_bytes(s) for s in embedded]
        shaped = None
        if any(s.row_shape() is not None for s in seqs):
            mx.async_eval(logits, self.pool.arrays())  # the forward runs while the host shapes
            shaped = self._shape(seqs, logits.shape[-1])
        toks, lps = sample(logits, [self._sample_row(seq) for seq in seqs], self._bias(shaped))
        mx.eval(toks, [x for x in lps if x is not None], self.pool.arrays(), [s.embedding for s in embedded])
        out = [Sampled(seq, tok, lp) for seq, tok, lp in zip(seqs, toks.tolist(), lps)]
        for i, why in (shaped.dead if shaped else ()):
            out[i] = Sampled(seqs[i], None, error=why)
        return out + [self._vector_bytes(s) for s in embedded]

    # ================================================================ embeddings
    def _pool(self, plan: PrefillPlan, hidden: mx.array) -> list[Sampled]:
        """Pool the embedding rows of a prefill pass (``hidden``: the pass's final hidden states): a
        mean row adds its chunk's positions to its sum; a row whose prompt ends here gets its vector
        (lazy, in the Sampled's ``embedding``)."""
        done = []
        for i, (seq, n) in enumerate(plan.rows):
            spec = seq.spec.embed
            if spec is None:
                continue
            ends = n >= seq.num_uncomputed
            if spec.pooling == "mean":
                part = hidden[i, :n].astype(mx.float32).sum(axis=0)
                seq.pooled = part if seq.pooled is None else seq.pooled + part
                if ends:
                    done.append(Sampled(seq, None, embedding=seq.pooled / len(seq.tokens)))
            elif ends:  # last: the hidden state of the prompt's last token (decoder embedders)
                done.append(Sampled(seq, None, embedding=hidden[i, n - 1].astype(mx.float32)))
        for s in done:
            s.embedding = finish_vector(s.embedding, s.seq.spec.embed)
        return done

    @staticmethod
    def _vector_bytes(s: Sampled) -> Sampled:
        """An evaluated vector read back as little-endian float32 bytes (what crosses to the host)."""
        s.embedding = np.asarray(s.embedding, dtype="<f4").tobytes()
        return s

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Make the (source, destination) block copies, in place: the decode in flight is computed
        first (not read), since a pool array a pending pass still reads cannot be written in place
        and MLX would copy the whole array (docs/design/engine-notes.md)."""
        fl = self._inflight
        if fl is not None:
            mx.eval([x for x in (fl.toks, fl.logits, *fl.logprobs) if x is not None])
        src, dst = zip(*copies)
        self.pool.copy_blocks(src, dst)

    # ================================================================ shaping (grammar, penalties)
    def _shape(self, seqs: list[Sequence], width: int, alive=None) -> Shaped:
        """Host-side shaping of these rows (rows not ``alive`` are left alone: wasted rows)."""
        rows = [s.row_shape() if alive is None or alive(s) else None for s in seqs]
        return shape(rows, width, self.book)

    @staticmethod
    def _bias(shaped: Optional[Shaped]) -> Optional[mx.array]:
        return None if shaped is None or shaped.bias is None else mx.array(shaped.bias)

    # ================================================================ decode
    def decode(self, rows: list[Sequence]) -> list[Sampled]:
        """Launch one decode step over ``rows`` (not waited for), then read the previous launch.

        When a row needs its previous token on the host (a grammar, a penalty), the launch
        runs the forward pass only; ``sample_deferred`` samples it
        once the scheduler has consumed the tokens read here."""
        prev = self._inflight
        self._inflight = self._launch(rows, prev) if rows else None
        return self._read(prev)

    def sample_deferred(self, alive) -> list[tuple[Sequence, str]]:
        """Sample a deferred launch now (its rows' grammars have consumed the previous tokens):
        masks and penalties are computed while its forward pass runs.  Returns the rows whose
        grammar allows no token (dead ends); ``alive(seq)``: the row still runs."""
        fl = self._inflight
        if fl is None or fl.toks is not None:
            return []
        shaped = self._shape(fl.seqs, fl.logits.shape[-1], alive)
        fl.toks, fl.logprobs = sample(fl.logits, [self._sample_row(s) for s in fl.seqs], self._bias(shaped))
        fl.logits = None
        mx.async_eval(fl.toks, [x for x in fl.logprobs if x is not None])
        return [(fl.seqs[i], why) for i, why in shaped.dead]

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
        batch = [BatchRow(s.block_table, s.num_computed, 1) for s in rows]
        fast = self.decode_forward
        if fast is not None and fast.current():
            logits = self.head(fast(batch, inputs))
        else:
            logits = self.forward(batch, inputs)
        if any(s.needs_host_tokens for s in rows):
            mx.async_eval(logits)
            return _InFlight(rows, None, [], logits)
        sample_rows = []
        for s in rows:
            i = where[id(s)] if s.pending and s.spec.logits_processors else None
            sample_rows.append(self._sample_row(s, None if i is None else prev_toks[i:i + 1]))
        shaped = self._shape(rows, logits.shape[-1]) if any(s.spec.logit_bias for s in rows) else None
        toks, lps = sample(logits, sample_rows, self._bias(shaped))
        mx.async_eval(toks, [x for x in lps if x is not None])
        return _InFlight(rows, toks, lps)

    # ================================================================ speculative decoding
    @staticmethod
    def can_verify(seq: Sequence) -> bool:
        """Whether a verify pass samples ``seq``'s positions as its decode steps would: greedy or the
        engine's own sampler (its draws keyed by step), no logits processors (callables with state
        of their own)."""
        spec = seq.spec
        return (spec.embed is None and not spec.logits_processors
                and (spec.sampler is None or isinstance(spec.sampler, RowSampler)))

    def verify_pads(self) -> bool:
        """Whether a verify pass computes every row to the longest proposal (the model file's ragged
        rows, a padded batch), rather than each row's own positions (the decode forward's)."""
        fast = self.decode_forward
        return fast is None or not fast.current()

    def verify(self, rows: list[Sequence], drafts: list[list[int]]) -> list[list[Sampled]]:
        """One forward over each row's last token and its proposal ``drafts[i]`` (may be empty),
        evaluated and read.  Each of a row's 1 + k positions is shaped and drawn as a decode step at
        that place would be (its grammar and penalties past the proposal's earlier tokens; its
        RowSampler draws steps n..n+k in order); a row's tokens are those drawn while they equal its
        proposal, then the first that differs (or the one after a proposal accepted whole), and its
        sampler's step is left after the last of them.  Nothing may be in flight."""
        assert self._inflight is None, "a verify pass with a decode in flight"
        where = [(i, j) for i, d in enumerate(drafts) for j in range(1 + len(d))]
        if not self.verify_pads():
            fast = self.decode_forward
            # each position a decode row of its own: its sequence's table, one token at its place (a
            # layer writes every position's K/V before any attends, and each attends to its own
            # length), so exactly the decode step at that position, with no padding and the decode
            # step's host work
            batch = [BatchRow(s.block_table, s.num_computed + j, 1) for s, d in zip(rows, drafts)
                     for j in range(1 + len(d))]
            inputs = mx.array([t for s, d in zip(rows, drafts) for t in [s.tokens[-1]] + d], dtype=mx.int32)
            logits = self.head(fast(batch, inputs[:, None]))
        else:
            width = 1 + max(len(d) for d in drafts)
            batch = [BatchRow(s.block_table, s.num_computed, 1 + len(d)) for s, d in zip(rows, drafts)]
            inputs = mx.array([[s.tokens[-1]] + d + [0] * (width - 1 - len(d)) for s, d in zip(rows, drafts)])
            out = self.run(batch, inputs)
            at = out[mx.array([i for i, _ in where]), mx.array([j for _, j in where])]
            logits = self.head(at) if self.split_head else at
        sample_rows, shapes = [], []
        for s, d in zip(rows, drafts):
            for j in range(1 + len(d)):
                grammar = s.grammar.after(d[:j]) if s.grammar is not None and j else None
                shapes.append(s.row_shape(d[:j], grammar))
                sample_rows.append(self._sample_row(s, ahead=d[:j]))
        shaped = None
        if any(r is not None for r in shapes):
            mx.async_eval(logits, self.pool.arrays())  # the forward runs while the host shapes
            shaped = shape(shapes, logits.shape[-1], self.book)
        toks, lps = sample(logits, sample_rows, self._bias(shaped))
        mx.eval(toks, [x for x in lps if x is not None], self.pool.arrays())
        flat = [Sampled(rows[i], tok, lp) for (i, _), tok, lp in zip(where, toks.tolist(), lps)]
        for k, why in (shaped.dead if shaped else ()):
            flat[k] = Sampled(flat[k].seq, None, error=why)
        out_rows, k = [], 0
        for s, d in zip(rows, drafts):
            row = flat[k:k + 1 + len(d)]
            k += len(row)
            n = next((j + 1 for j, x in enumerate(row[:-1]) if x.token != d[j]), len(row))
            if isinstance(s.spec.sampler, RowSampler):
                s.spec.sampler.step -= len(row) - n  # the draws past the last token emitted are drawn again
            out_rows.append(row[:n])
        return out_rows

    @staticmethod
    def _read(fl: Optional[_InFlight]) -> list[Sampled]:
        if fl is None:
            return []
        assert fl.toks is not None, "a deferred launch is read before it was sampled"
        return [Sampled(seq, tok, lp) for seq, tok, lp in zip(fl.seqs, fl.toks.tolist(), fl.logprobs)]

    @staticmethod
    def _sample_row(seq: Sequence, pending_tok: Optional[mx.array] = None, ahead: list[int] = ()) -> SampleRow:
        """``ahead``: proposed tokens taken as its context's last (a verify pass's later positions)."""
        spec = seq.spec
        ctx = None
        if spec.logits_processors:
            ctx = mx.array(seq.tokens)
            if pending_tok is not None:
                ctx = mx.concatenate([ctx, pending_tok])
        repetition = None
        if spec.repetition_penalty is not None:  # a deferred row: its context is all on the host
            window = seq.tokens[-REPETITION_CONTEXT:] + list(ahead)
            repetition = (spec.repetition_penalty, window[-REPETITION_CONTEXT:])
        return SampleRow(spec.sampler, spec.logits_processors, ctx, spec.want_logprobs, repetition)


def finish_vector(v: mx.array, spec: EmbedSpec) -> mx.array:
    """A pooled vector cut to ``spec.dimensions`` (Matryoshka truncation), then L2-normalised."""
    if spec.dimensions is not None:
        v = v[:spec.dimensions]
    if spec.normalize:
        v = v / mx.maximum(mx.sqrt((v * v).sum()), 1e-12)
    return v
