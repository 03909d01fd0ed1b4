"""The contract between the worker loop and a generation engine.

The worker (its MLX loop, ``mlxq.worker.mlx_loop``; Redis, detokenizing, stop strings and
stats live in its other rooms) talks to the engine (``mlxq.worker.engine.PagedEngine``) only through these types:
``Engine`` lists every method it calls.  Every method is called on the single MLX
thread.  Token ids, never text, cross this boundary.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol, Sequence

# A sampler maps log-probabilities of shape (1, vocab) to a token array (1,).
Sampler = Callable[[Any], Any]
# A logits processor maps (token context array, logits (1, vocab)) to logits.
LogitsProcessor = Callable[[Any, Any], Any]


POOLINGS = ("last", "mean")  # an embedding's pooling rule: the last token's hidden state, or the mean of all


@dataclass(frozen=True)
class EmbedSpec:
    """A sequence that is embedded, not generated: prefill only, then its final hidden states (the
    model's last norm, before the LM head) pooled, truncated to ``dimensions`` and L2-normalised."""

    pooling: str = "last"  # one of POOLINGS
    normalize: bool = True
    dimensions: Optional[int] = None  # keep the first this many (None: all), normalised after the cut


@dataclass
class SeqSpec:
    """One sequence handed to an engine."""

    uid: str  # the job id (``f"{job_id}#{i}"`` for sample i of an n > 1 job)
    prompt: list[int]  # prompt token ids (never empty)
    max_tokens: int  # tokens still to generate
    sampler: Optional[Sampler] = None  # None: greedy
    logits_processors: list[LogitsProcessor] = field(default_factory=list)
    # end-of-sequence ids (finish with "stop"); None: the engine's default EOS ids; (): none
    stop_token_ids: Optional[Sequence[int]] = None
    # Tokens this job already generated in an earlier run (preemption resume):
    # they are part of the context but are not emitted again.
    resume_tokens: list[int] = field(default_factory=list)
    priority: float = 0.0  # the job's queue score: lower is more urgent
    session_id: Optional[str] = None
    # compute log-probabilities for this job's tokens (TokenEvent.logprobs); off, no
    # logsumexp over the vocabulary runs for it
    want_logprobs: bool = False
    # An llguidance grammar (mlxq.shared.constraints) every token must follow: the engine
    # masks the row's logits to the tokens it allows; its state is rebuilt from
    # resume_tokens.  A complete grammar allows only EOS; one that stops ends the job
    # ("stop"); a dead end ends it with finish_reason "error" (TokenEvent.error).
    grammar: Optional[str] = None
    # OpenAI's penalties over the tokens this job generated (resume tokens included)
    # and a static bias per token id; zeros / None: the row keeps the fast path
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Optional[dict[int, float]] = None
    # mlx-lm's repetition penalty over the last 20 context tokens, applied to all such rows of
    # a batch at once (None: off); the same logits as mlx-lm's logits processor
    repetition_penalty: Optional[float] = None
    # n > 1 samples of one job: the uid of the sibling (sample 0) whose prompt KV this sequence may
    # share, and how many leading tokens of ``prompt`` are that shared prompt (the rest, e.g. resume
    # tokens, are its own).  The engine waits for the sibling's prefill, shares its full blocks and
    # copies its last partial one; a sibling that is gone means an ordinary admission.
    fork_of: Optional[str] = None
    fork_len: int = 0
    # an embedding job: the engine prefills the prompt and ends the sequence with its pooled vector
    # (TokenEvent.embedding); it never reads or fills the prefix cache's hits (mean pooling needs the
    # hidden state of every position), and generates nothing
    embed: Optional[EmbedSpec] = None


@dataclass
class TokenEvent:
    """One generated token, or the end of a sequence."""

    uid: str
    token: Optional[int]  # None: no token (an "error" end: the job's constraint dead-ended)
    finish_reason: Optional[str] = None  # None, "stop", "length" or "error"
    logprobs: Any = None  # mx.array (vocab,) of log-probabilities (when the spec wants them), or None
    # prompt tokens whose KV came from the prefix cache at the sequence's last admission; None: unknown
    cached_tokens: Optional[int] = None
    error: Optional[str] = None  # why the sequence ended with "error" (its constraint failed)
    # an embedding sequence's end (finish_reason "stop", token None): its vector as little-endian float32
    embedding: Optional[bytes] = None
    # speculative decoding: the proposal verified in the pass this token came from, on the first event of
    # that pass's run (tokens proposed, of which accepted); summed over a job's events, its own counts
    draft_proposed: int = 0
    draft_accepted: int = 0


@dataclass
class Preempted:
    """The engine gave a running sequence's memory away.

    ``tokens`` are all tokens it generated so far (including earlier resumes);
    the worker requeues the job and later resubmits it with
    ``resume_tokens=tokens``.
    """

    uid: str
    tokens: list[int]


class Engine(Protocol):
    """Everything the worker loop calls on its engine (tests check the runner calls nothing else)."""

    def add(self, specs: list[SeqSpec]) -> None:
        """Queue sequences; they join the running batch at the next step."""

    def remove(self, uids: list[str]) -> None:
        """Drop sequences (cancelled, or finished by a stop string) at once; a bare job id also
        drops that job's ``job_id#i`` samples."""

    def step(self) -> tuple[list[TokenEvent], list[Preempted]]:
        """Run one scheduling step: at most one new token per running sequence."""

    def has_work(self) -> bool:
        """True while any sequence is queued, prefilling or decoding."""

    def free_slots(self) -> int:
        """How many more sequences the worker may hand over right now."""

    def urgent_below(self) -> float:
        """A queued job with a priority score below this would preempt a running sequence now.

        While the engine has no free slot the worker peeks at the head of the queue and
        pulls such a job at once; -inf when none would.
        """

    def can_admit(self, prompt_len: int, max_tokens: int) -> bool:
        """Whether a sequence of this size could ever fit (for early refusal)."""

    def stats(self) -> dict:
        """Engine counters for the aggregate stats (flat str -> number)."""

    def close(self) -> None:
        """The worker stops: finish what must outlive it (spill hot sessions to disk)."""
