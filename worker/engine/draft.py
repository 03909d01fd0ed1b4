"""A draft model's proposals (``--speculate draft --draft-model PATH``): a smaller model with the
same tokenizer proposes k tokens greedily; the engine verifies them as it verifies prompt lookup's.

Its KV lives in a pool of its own with as many blocks as the engine's, indexed by the sequence's own
block table: block b of the draft pool holds the draft model's keys and values for the tokens block b
of the engine's pool holds.  So the target's slots for a verify pass are the draft's too, and blocks
released after a rejection are released for both.  A sequence's draft KV is good up to
``Drafting.draft_computed`` (reset at every admission: a prefix-cache hit brings the target's KV, not
the draft's); a proposal first catches the draft up over the tokens since (the whole prompt after an
admission: one ragged pass, cheap for a small model), then runs k - 1 one-token steps, each feeding
the argmax of the one before, built lazily and evaluated once.  Tokens written for positions past the
accepted ones are overwritten later, like the target's.
"""

from __future__ import annotations

import mlx.core as mx

from .kv_cache import BatchRow, KVPool, probe_kv_shape
from .model_runner import ModelRunner
from .sampler import greedy
from .sequence import Sequence


class Drafter:
    def __init__(self, model, num_blocks: int, block_size: int):
        shape = probe_kv_shape(model)
        self.pool = KVPool(shape, num_blocks, block_size, dtype=shape.dtype)
        self.runner = ModelRunner(model, self.pool)

    def propose(self, rows: list[Sequence], ks: list[int]) -> list[list[int]]:
        """Up to ``ks[i]`` greedy tokens of the draft model after each row's last token (rows with k 0
        get []); every row's slots for its last token and k more positions are in its block table."""
        live = [(s, k) for s, k in zip(rows, ks) if k > 0]
        if not live:
            return [[] for _ in rows]
        starts = [min(s.drafting.draft_computed, s.num_computed) for s, _ in live]
        feeds = [s.tokens[start:] for (s, _), start in zip(live, starts)]
        width = max(len(f) for f in feeds)
        batch = [BatchRow(s.block_table, start, len(f)) for (s, _), start, f in zip(live, starts, feeds)]
        inputs = mx.array([f + [0] * (width - len(f)) for f in feeds])
        last = mx.array([len(f) - 1 for f in feeds])
        first = greedy(self.runner.forward(batch, inputs, last)).astype(mx.int32)
        chains = [[first[i]] for i in range(len(live))]  # each row's proposal, lazy
        offsets = [start + len(f) for start, f in zip(starts, feeds)]
        for j in range(1, max(k for _, k in live)):
            # step j writes position offset + j - 1: only rows whose k reaches it (their slots end there)
            active = [i for i, (_, k) in enumerate(live) if k > j]
            batch = [BatchRow(live[i][0].block_table, offsets[i] + j - 1, 1) for i in active]
            fed = mx.stack([chains[i][-1] for i in active])[:, None]
            tok = greedy(self.runner.forward(batch, fed)).astype(mx.int32)
            for n, i in enumerate(active):
                chains[i].append(tok[n])
        mx.eval(chains, self.pool.arrays())
        out, it = [], iter(zip(live, chains, offsets))
        for s, k in zip(rows, ks):
            if k <= 0:
                out.append([])
                continue
            (_, k), chain, off = next(it)
            s.drafting.draft_computed = off  # its tokens' KV; the proposals' is good only where accepted
            out.append([int(t.item()) for t in chain])
        return out
