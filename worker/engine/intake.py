"""From a ``SeqSpec`` to a waiting ``Sequence``: what the engine refuses or trims before it queues one.

A context that cannot fit the pool ends at once: waiting, it would never be admitted, and every
sequence behind it would wait too.  One whose ``max_tokens`` would exhaust the pool mid-decode is
capped where the pool ends (it finishes with "length").  Fork fields that cannot hold are dropped
(``forks.checked``), and a constrained sequence's matcher starts at its resume point; a constraint
that cannot start ends the job with "error".  The worker asks ``can_admit`` first and refuses such
jobs itself; a caller of the engine meets these.
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
