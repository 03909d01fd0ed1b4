"""One sequence in the engine (its tokens, its blocks, where it stands), the prefill plan the scheduler
hands the model runner, and the step's counters: plain data, no MLX."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Optional, Sequence as Seq

from .api import SeqSpec
from .logit_shaping import RowGrammar, RowShape
from .speculative import Drafting


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued in the engine (also after a release)
    PREFILL = "prefill"  # admitted: blocks allocated, prompt chunks still to compute
    DECODE = "decode"  # prompt computed: one token per step


@dataclass
class Sequence:
    spec: SeqSpec
    arrival: int  # admission order among equal priorities
    tokens: list[int]  # prompt + resume tokens + tokens generated this run
    num_context: int  # len(prompt) + len(resume_tokens)
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # committed full blocks
    num_computed: int = 0  # tokens whose KV is in the pool
    emitted: int = 0  # tokens emitted this run
    session_checked: bool = False  # warm session file looked at already
    prefix_hit: int = 0  # prompt tokens found in the prefix cache at the last admission (reported per job)
    pending: int = 0  # tokens sampled by a launched decode, not yet read (0 or 1)
    grammar: Optional[RowGrammar] = None  # the spec's grammar, fed every emitted token
    # an embedding sequence's pooling so far (the model runner's float32 array: the sum of the hidden
    # states of its computed positions for mean pooling), rebuilt from scratch after a release
    pooled: object = None
    drafting: Optional[Drafting] = None  # its speculation state, once it was offered a proposal

    def draft_state(self) -> Drafting:
        if self.drafting is None:
            self.drafting = Drafting()
        return self.drafting

    @property
    def needs_host_tokens(self) -> bool:
        """Its next token's logits depend on the token before it as read back (a grammar mask,
        penalties): a decode samples it after reading that token."""
        spec = self.spec
        return (self.grammar is not None or spec.repetition_penalty is not None
                or bool(spec.presence_penalty or spec.frequency_penalty))

    def row_shape(self, ahead: Seq[int] = (), grammar: Optional[RowGrammar] = None) -> Optional[RowShape]:
        """What shaping its logits need (None: none); ``ahead``: proposed tokens taken as generated
        (a verify pass's later positions), with ``grammar`` the matcher past them."""
        spec = self.spec
        if not (self.needs_host_tokens or spec.logit_bias):
            return None
        return RowShape(grammar or self.grammar, self.generated + list(ahead), spec.presence_penalty,
                        spec.frequency_penalty, spec.logit_bias)

    @property
    def uid(self) -> str:
        return self.spec.uid

    @property
    def generated(self) -> list[int]:
        """Everything generated for this job, earlier runs included."""
        return self.tokens[len(self.spec.prompt):]

    @property
    def num_uncomputed(self) -> int:
        """Tokens whose KV is not in the pool yet (the rest of the prompt, while prefilling)."""
        return len(self.tokens) - self.num_computed

    def rank(self):
        """(priority score, arrival): the min is the most urgent, the max the preemption victim."""
        return (self.spec.priority, self.arrival)

    def place(self, block_table: list[int], block_hashes: list[bytes], num_computed: int) -> None:
        """Admitted: its blocks (the first ``len(block_hashes)`` reused, already computed), its
        prompt to prefill from ``num_computed`` on."""
        self.block_table, self.block_hashes = block_table, list(block_hashes)
        self.num_computed = num_computed
        self.status = SequenceStatus.PREFILL
        if self.drafting is not None:  # a hit brings the engine's KV, not a draft model's
            self.drafting.draft_computed = 0

    def commit_computed(self, bm) -> None:
        """Its blocks whose every token is computed and known go into ``bm``'s prefix cache."""
        bm.commit_full(self.block_table, self.block_hashes, self.tokens, min(self.num_computed, len(self.tokens)))

    def release(self) -> None:
        """Back to waiting, holding no block (its owner deallocated them)."""
        self.block_table, self.block_hashes = [], []
        self.num_computed = self.pending = 0
        self.pooled = None
        self.status = SequenceStatus.WAITING

    def append_token(self, token: int, eos_token_ids) -> Optional[str]:
        """Take an emitted token; why it ends the sequence ("stop": a stop id, or its grammar is
        complete; "length": max_tokens) or None.  Stop ids: its spec's, else ``eos_token_ids``."""
        self.tokens.append(token)
        self.emitted += 1
        stops = eos_token_ids if self.spec.stop_token_ids is None else self.spec.stop_token_ids
        if token in stops or (self.grammar is not None and self.grammar.stopped):
            return "stop"
        return "length" if self.emitted >= self.spec.max_tokens else None


@dataclass
class Sampled:
    """A token the model runner sampled for a sequence (read back to the host)."""

    seq: Sequence
    token: Optional[int]  # None: no token could be sampled (``error`` says why)
    logprobs: object = None  # the runner's (vocab,) log-probabilities when the spec wants them, else None
    error: Optional[str] = None  # the row's constraint dead-ended
    embedding: Optional[bytes] = None  # an embedding sequence's pooled vector (token None): it ends


@dataclass
class StepCounters:
    """The engine's running totals (the scheduler and its rooms count; ``stats()`` reports them)."""

    prefix_hit_tokens: int = 0
    fork_shared_tokens: int = 0  # prompt tokens a forked sample took from its sibling (not computed again)
    prompt_tokens: int = 0  # context tokens of admitted sequences (a fork's: those it did not share)
    preemptions: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    session_spills: int = 0
    session_restores: int = 0
    steps: int = 0
    prefill_passes: int = 0
    decode_passes: int = 0
    verify_passes: int = 0  # decode passes that verified proposals (speculative decoding)
    draft_proposed: int = 0  # proposed tokens verified
    draft_accepted: int = 0  # of which accepted


@dataclass
class PrefillPlan:
    """One ragged prefill pass: (sequence, tokens this pass), most urgent first."""

    rows: list[tuple[Sequence, int]]
    ending: list[int] = field(init=False)  # rows whose prompt ends in this pass: their next token is sampled
    # (source block, destination block) copies to make before the pass (forked samples' last partial
    # block); a plan may carry copies and no rows
    copies: list[tuple[int, int]] = field(default_factory=list)
    # (waiting sample, index into ``ending``): forked samples whose sibling's prompt ends in this pass
    # draw their first token from the sibling's logits (the same context, so the same logits), so
    # every sample of a job starts decoding in the same step
    firsts: list[tuple[Sequence, int]] = field(default_factory=list)

    def __post_init__(self):
        self.ending = [i for i, (seq, n) in enumerate(self.rows) if n >= seq.num_uncomputed]

    def ending_seqs(self) -> list[Sequence]:
        return [self.rows[i][0] for i in self.ending]
