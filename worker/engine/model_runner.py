"""The paged engine's tensor side: forward passes over the pool, batched sampling.

No scheduling policy lives here: the engine decides which rows run; this module
turns rows into one forward pass (``forward``) and one batched sampling call
(``sample``).  Everything returned is lazy; the engine decides when to
evaluate (``mx.async_eval`` to overlap the next step with handing out tokens).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import mlx.core as mx

from .sampler import RowSampler, sample_rows
from .kv_cache import BatchRow, BatchView, KVPool, make_layer_caches


@dataclass
class SampleRow:
    """What sampling needs to know about one row."""

    sampler: object  # None (greedy), a RowSampler, or any callable (1, V) logprobs -> (1,)
    processors: Sequence  # logits processors (ctx, logits) -> logits
    context: Optional[mx.array]  # token context for processors (built only when there are some)
    want_logprobs: bool


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

    def sample(self, logits: mx.array, rows: list[SampleRow]):
        """Tokens (B,) for each row, and per-row log-probabilities (None where not asked).

        Greedy rows share one argmax; sampled rows that share a configuration
        are sampled in one call (each row from its own key); log-probabilities
        (a logsumexp over the vocabulary) only for rows that ask for them or
        whose sampler needs them.
        """
        B = logits.shape[0]
        if any(r.processors for r in rows):
            parts = []
            for i, r in enumerate(rows):
                x = logits[i:i + 1]
                for proc in r.processors:
                    x = proc(r.context, x)
                parts.append(x)
            logits = mx.concatenate(parts, axis=0)
        need_lp = [r.want_logprobs or r.sampler is not None for r in rows]
        logprobs = None
        if any(need_lp):
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        if all(r.sampler is None for r in rows):
            toks = mx.argmax(logits, axis=-1)
        else:
            toks = self._sample_mixed(logits, logprobs, rows)
        lps = [logprobs[i] if rows[i].want_logprobs else None for i in range(B)]
        return toks, lps

    @staticmethod
    def _sample_mixed(logits, logprobs, rows: list[SampleRow]) -> mx.array:
        greedy = mx.argmax(logits, axis=-1)
        groups: dict = {}
        for i, r in enumerate(rows):
            if r.sampler is None:
                continue
            key = r.sampler.config if isinstance(r.sampler, RowSampler) else ("callable", i)
            groups.setdefault(key, []).append(i)
        index, values = [], []
        for key, idx in groups.items():
            sub = logprobs[mx.array(idx)] if len(idx) < len(rows) else logprobs
            first = rows[idx[0]].sampler
            if isinstance(first, RowSampler):
                values.append(sample_rows(sub, [rows[i].sampler for i in idx]).astype(greedy.dtype))
            else:
                values.append(first(sub).reshape(-1).astype(greedy.dtype))
            index.extend(idx)
        greedy[mx.array(index, dtype=mx.int32)] = mx.concatenate(values)
        return greedy
