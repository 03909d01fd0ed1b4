"""What the engine takes in: how many jobs the worker may hand it, which queued job would preempt,
whether a job fits at all, and a ``SeqSpec`` made a waiting ``Sequence``.

The worker asks ``free_slots`` and ``urgent_below`` before it pulls from Redis and ``can_admit``
before it prepares a job; the engine answers them here from its ``Scheduler`` (``sched``, whose
policy starts once a sequence waits).

A context that cannot fit the pool ends at once: waiting, it would never be admitted, and every
sequence behind it would wait too.  One whose ``max_tokens`` would exhaust the pool mid-decode is
capped where the pool ends (it finishes with "length").  Fork fields that cannot hold are dropped
(``forks.checked``), and a constrained sequence's matcher starts at its resume point; a constraint
that cannot start ends the job with "error".  The worker refuses with ``can_admit`` what would not
fit; a caller of the engine meets these.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Callable, Iterator, Optional

from . import forks
from .api import SeqSpec
from .logit_shaping import GrammarError, RowGrammar
from .sequence import Sequence

log = logging.getLogger(__name__)

StartGrammar = Callable[[str, list[int]], RowGrammar]


def free_slots(sched) -> int:
    """Keep pulling while up to ``max_waiting`` jobs wait in the engine for memory.

    Jobs waiting inside the engine are admitted (in priority order) the moment blocks free up,
    and a more urgent one preempts at once; beyond the bound the rest stay in Redis for other
    workers.
    """
    cfg, bm = sched.config, sched.bm
    n_seqs = len(sched.waiting) + len(sched.running)
    if cfg.max_batch is not None:
        return max(0, cfg.max_batch - n_seqs)
    # samples waiting for their sibling's prefill do not wait for memory
    n_waiting = sum(1 for s in sched.waiting if not sched.forks.held(s, sched.live))
    if n_seqs >= cfg.max_sequences or n_waiting >= cfg.max_waiting:
        return 0
    headroom = int(cfg.pressure * bm.num_blocks) - bm.num_used
    # At least one: a more urgent job may need to reach us to preempt.
    # as many as fit now (about 4 blocks each), plus up to max_waiting that wait here
    return max(1, min(cfg.max_sequences - n_seqs,
                      max(0, headroom // 4) + cfg.max_waiting - n_waiting))


def urgent_below(sched) -> float:
    """A queued job with a priority below this would preempt a running sequence now (the
    scheduler's rule: at least ``priority_gap`` below its victim); -inf when none would (nothing
    runs, or a waiting job already would: it goes first)."""
    if not sched.running:
        return float("-inf")
    threshold = sched.victim().spec.priority - sched.config.priority_gap
    if any(w.spec.priority <= threshold for w in sched.waiting):
        return float("-inf")
    return threshold


def can_admit(sched, prompt_len: int, max_tokens: int) -> bool:
    """Whether a job of this size could ever fit the pool, beside the decode reserve."""
    need = sched.bm.blocks_needed(prompt_len + max(1, max_tokens))
    return need + sched.config.decode_reserve_blocks <= sched.bm.num_blocks


def make_sequence(spec: SeqSpec, arrivals: Iterator[int], pool_tokens: int,
                  start_grammar: Optional[StartGrammar]) -> tuple[Optional[Sequence], Optional[str]]:
    """The sequence to queue (its arrival number drawn from ``arrivals``), or None and why the spec
    ends now; ``pool_tokens``: the tokens one sequence may hold (the pool less the decode reserve)."""
    if not spec.prompt:
        raise ValueError(f"{spec.uid}: empty prompt")
    ctx = list(spec.prompt) + list(spec.resume_tokens)
    if len(ctx) + 1 > pool_tokens:
        why = (f"{len(ctx)} context tokens (and one to generate) do not fit this KV pool "
               f"({pool_tokens} tokens)")
        log.warning("%s: %s", spec.uid, why)
        return None, why
    if len(ctx) + spec.max_tokens > pool_tokens:
        log.warning("%s: %d + %d tokens exceed the pool; max_tokens capped",
                    spec.uid, len(ctx), spec.max_tokens)
        spec = replace(spec, max_tokens=max(1, pool_tokens - len(ctx)))
    seq = Sequence(forks.checked(spec), next(arrivals), ctx, len(ctx))
    if spec.grammar is not None:
        why = _start_grammar(seq, start_grammar)
        if why is not None:
            return None, why
    return seq, None


def _start_grammar(seq: Sequence, start_grammar: Optional[StartGrammar]) -> Optional[str]:
    """Build the sequence's matcher (at its resume point); why it cannot start (None: it did)."""
    try:
        if start_grammar is None:
            raise GrammarError("this engine has no tokenizer: constrained output is unavailable")
        seq.grammar = start_grammar(seq.spec.grammar, list(seq.spec.resume_tokens))
        return None
    except GrammarError as exc:
        log.warning("%s: %s", seq.uid, exc)
        return str(exc)
    except Exception as exc:  # the grammar library's own failure: this job's, not the engine's
        log.exception("%s: starting its constraint failed", seq.uid)
        return f"starting the constraint failed: {exc}"
