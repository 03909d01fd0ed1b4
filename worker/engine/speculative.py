"""Speculative decoding's policy: prompt-lookup proposals, each sequence's k, and whether a step
speculates at all.  Plain Python, no MLX (the verify pass is ``ModelRunner.verify``).

A proposal is what followed the most recent earlier occurrence of the sequence's last n tokens
(n from ``MAX_NGRAM`` down to 1) in its own context, prompt and output alike: extraction and
rewriting copy spans of their input, and there the continuation is often right for many tokens.
The engine verifies it in one forward over the k + 1 positions and keeps each sampled token while it
equals the proposal (``docs/design/speculative.md``: why that output is the non-speculative one).

What adapts:

* each sequence's k: one more after a proposal accepted whole, one less after a rejection, between 1
  and ``k_max``; its acceptance rate (a moving average over verdicts) says what a proposal of k is
  worth.  A row keeps one rate per cue, the length of the n-gram match of its tokens read when the
  step decides (its last token is still in flight then, so the match its proposal will come from is
  not known yet, but the one before it predicts it): inside a copied span the cue is the longest
  and proposals are accepted far more often than after a one-token match, which an average over
  both hides (docs/design/speculative.md).  While the row is not picked the rate of its cue drifts
  back up toward the prior, so a row refused on a few early rejections is tried again where the
  step costs allow it;
* whether a step speculates, and which rows: :class:`StepCosts` keeps an online fit of a step's time
  against the positions it computes (plain, pipelined decode steps and verify steps alike, with
  what a verify step loses apart; the choice is a cap on k, each row's proposal cut to it, and a
  pass computes each row's own positions or, through the model file, every row to the longest); a
  step speculates when the tokens it expects per second beat the plain step's, and once every
  EXPLORE_EVERY plain steps anyway with proposals cut to cost at most PROBE_POSITIONS more positions
  (the estimates stay fresh).  Output is the same either way, so this choice only moves speed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence as Seq

import numpy as np


MAX_NGRAM = 3  # the longest suffix looked up
START_K = 4  # a new sequence's k
ACCEPT_PRIOR = 0.5  # a new sequence's acceptance rate, before its first verdict
RATE_WEIGHT = 0.3  # the moving average's weight on the newest verdict
RECOVER = 0.1  # how far a row's rate moves back up toward ACCEPT_PRIOR at each step it is not picked
FORGET = 0.97  # StepCosts: a step's weight decays by this much per later step of its kind
MIN_FIT_STEPS = 3  # steps of each kind measured before the fit decides
EXPLORE_EVERY = 64  # plain steps after which a step speculates anyway (fresh step times and acceptance)
PROBE_POSITIONS = 8  # the extra positions (over the batch) a probe may cost: its cap is this over the rows


class NgramIndex:
    """The most recent end position of every 1..MAX_NGRAM-gram of a token list that only grows
    (a sequence's tokens), indexed lazily up to the one before the last position."""

    def __init__(self):
        self._ends: dict[tuple, int] = {}
        self._upto = 0  # n-grams ending before this position are indexed

    def propose(self, tokens: Seq[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the longest suffix of
        ``tokens`` (at most MAX_NGRAM long) seen before; [] when none was."""
        n, end = self._match(tokens)
        return list(tokens[end:end + k]) if n and k > 0 else []

    def match(self, tokens: Seq[int]) -> int:
        """The length of the longest suffix of ``tokens`` seen before (0: none)."""
        return self._match(tokens)[0]

    def _match(self, tokens: Seq[int]) -> tuple[int, int]:
        last = len(tokens) - 1  # the suffix ends at len(tokens): index every n-gram ending before it
        for end in range(max(self._upto, 1), last + 1):
            for n in range(1, min(MAX_NGRAM, end) + 1):
                self._ends[tuple(tokens[end - n:end])] = end
        self._upto = max(self._upto, last + 1)
        for n in range(min(MAX_NGRAM, len(tokens)), 0, -1):
            end = self._ends.get(tuple(tokens[len(tokens) - n:]))
            if end is not None:
                return n, end
        return 0, 0


def probe_cap(rows: int, top: int) -> int:
    """The cap on k of a probe (a verify step the costs did not choose) of ``rows`` rows."""
    return max(1, min(top, PROBE_POSITIONS // rows))


def expected(rate: float, k: int) -> float:
    """Tokens a proposal of ``k`` is expected to add: each next one accepted with probability ``rate``
    once those before it were."""
    return k if rate >= 1.0 else rate * (1 - rate ** k) / (1 - rate)


@dataclass
class Drafting:
    """One sequence's speculation state (``Sequence.drafting``)."""

    index: NgramIndex = field(default_factory=NgramIndex)
    k: int = START_K
    # accepted / proposed, a moving average over verdicts, one per cue (see ``cue``)
    rates: list = field(default_factory=lambda: [ACCEPT_PRIOR] * (MAX_NGRAM + 1))
    cue: int = 0  # the match length of its tokens read when the step was picked: the rate that applies
    proposed: int = 0  # tokens proposed and verified (this run)
    accepted: int = 0  # of which accepted
    tried: bool = False  # it was picked once (a sequence's first pick is not the step costs' to refuse)
    draft_computed: int = 0  # a draft model's KV of its tokens is good below this position (draft.py)

    @property
    def rate(self) -> float:
        return self.rates[self.cue]

    def verdict(self, proposed: int, accepted: int, k_max: int) -> None:
        """A proposal of ``proposed`` tokens kept ``accepted``: the rate and k move."""
        if proposed <= 0:
            return
        self.proposed += proposed
        self.accepted += accepted
        self.rates[self.cue] += RATE_WEIGHT * (accepted / proposed - self.rates[self.cue])
        self.k = min(k_max, self.k + 1) if accepted == proposed else max(1, self.k - 1)


class StepCosts:
    """Measured step times as a function of the positions a step computes (see the module doc).

    Weighted least squares of seconds = a + b * positions + c * verify, each step's weight decaying
    by FORGET per later step: b is what a position costs, c what a verify step loses (it reads its
    tokens at once: no launch overlaps the host's work).  Where the steps cannot tell c from b
    (every verify step at one size), c is taken as 0 and b carries both: speculation then looks
    dearer than it is, never cheaper."""

    def __init__(self):
        self._m = np.zeros((3, 3))  # sums of w * f f^T, f = (1, positions, verify)
        self._r = np.zeros(3)  # sums of w * f * seconds
        self.steps = [0, 0]  # plain, verify steps recorded
        self.since_verify = 0  # plain steps recorded since the last verify step
        self.always = False  # speculate at every step a row has a proposal (tests, the bench's --always)

    def record(self, verify: bool, positions: int, seconds: float) -> None:
        f = np.array([1.0, positions, float(verify)])
        self._m = self._m * FORGET + np.outer(f, f)
        self._r = self._r * FORGET + f * seconds
        self.steps[verify] += 1
        self.since_verify = 0 if verify else self.since_verify + 1

    def _coefficients(self) -> tuple[float, float, float]:
        m, r = self._m, self._r
        if np.linalg.cond(m) < 1e8:
            a, b, c = np.linalg.solve(m, r)
        else:  # no way to tell the verify steps' loss from a position's cost: both in b
            a, b = np.linalg.lstsq(m[:2, :2], r[:2], rcond=None)[0] if np.linalg.cond(m[:2, :2]) < 1e8 \
                else (r[0] / m[0, 0], 0.0)
            c = 0.0
        return a, max(0.0, b), max(0.0, c)

    def choose(self, rows: int, offers: list[tuple[int, float]], padded: bool = True) -> tuple[list[int], int]:
        """Which rows speculate this step and the most tokens any proposes: indexes into ``offers``
        ((k, acceptance rate) of each row that could) and a cap on k, or ([], 0) when a plain step of
        ``rows`` rows is expected to make tokens faster.  For each cap every offered row takes part
        and the cap with the most expected tokens per second wins.  ``padded``: the verify pass
        computes every row to the longest proposal (rows x (1 + cap) positions), else each row its
        own (rows + the proposals' tokens)."""
        offered = [i for i, (k, _) in enumerate(offers) if k > 0]
        if not offered:
            return [], 0
        top = max(offers[i][0] for i in offered)
        if self.always:
            return offered, top
        if self.steps[False] < MIN_FIT_STEPS:
            return [], 0  # plain steps are measured first
        if self.steps[True] < MIN_FIT_STEPS or self.since_verify >= EXPLORE_EVERY:
            # then verify steps, and one now and then (the batch and its texts change): probes, whose
            # cap keeps them within PROBE_POSITIONS more positions (solo: a whole proposal; a big
            # batch: one token a row)
            return offered, probe_cap(rows, top)
        a, b, c = self._coefficients()
        best_rate, best = rows / max(1e-9, a + b * rows), ([], 0)
        for cap in range(1, top + 1):
            tokens = rows + sum(expected(offers[i][1], min(offers[i][0], cap)) for i in offered)
            positions = rows * (1 + cap) if padded else rows + sum(min(offers[i][0], cap) for i in offered)
            rate = tokens / max(1e-9, a + b * positions + c)
            if rate > best_rate:
                best_rate, best = rate, (offered, cap)
        return best


class Speculator:
    """The engine's speculation (mode "ngram"): which rows propose this step, and their proposals."""

    def __init__(self, k_max: int, can_verify: Callable[[object], bool], verify_pads: Callable[[], bool]):
        self.k_max = k_max
        self.can_verify = can_verify  # the runner's: a row whose sampling a verify pass can repeat
        self.verify_pads = verify_pads  # the runner's: whether a verify pass pads rows to the longest
        self.costs = StepCosts()

    def pick(self, rows: list) -> dict[int, int]:
        """{id(sequence): k} of the decode rows that speculate this step ({}: a plain step)."""
        seqs, offers = [], []
        for seq in rows:
            room = seq.spec.max_tokens - seq.emitted - seq.pending - 1  # past the token it samples anyway
            if room <= 0 or not self.can_verify(seq):
                continue
            d = seq.draft_state()
            d.cue = d.index.match(seq.tokens)
            seqs.append(seq)
            offers.append((min(d.k, room), d.rate))
        if not seqs:
            return {}
        chosen, cap = self.costs.choose(len(rows), offers, self.verify_pads())
        picked = set(chosen)
        if picked or (self.costs.steps[True] >= MIN_FIT_STEPS and len(rows) <= PROBE_POSITIONS):
            # a new sequence's first pick: its own acceptance is what no estimate knows yet (where the
            # costs said no, only in a batch a probe costs at most PROBE_POSITIONS more positions:
            # in a big one, arrivals would make every few steps a probe)
            fresh = [i for i, s in enumerate(seqs) if not s.drafting.tried]
            picked.update(fresh)
            if fresh and not cap:  # a probe where the costs said no
                cap = probe_cap(len(rows), max(offers[i][0] for i in fresh))
        for i, seq in enumerate(seqs):
            d = seq.drafting
            if i in picked:
                d.tried = True
            elif d.rate < ACCEPT_PRIOR:  # a rate no verdict updates any more recovers: the row gets tried again,
                d.rates[d.cue] += RECOVER * (ACCEPT_PRIOR - d.rate)  # as soon as the step costs allow at that rate
        return {id(seqs[i]): min(offers[i][0], cap) for i in picked}

    @staticmethod
    def room(seq, k: int) -> int:
        """``k`` cut to the tokens ``seq`` may still emit past its next one (its tokens all read)."""
        return max(0, min(k, seq.spec.max_tokens - seq.emitted - 1))

    @staticmethod
    def propose(seq, k: int) -> list[int]:
        """Up to ``k`` tokens to verify after ``seq``'s last one (its tokens all read: nothing
        pending): what its context's n-gram lookup offers."""
        return seq.draft_state().index.propose(seq.tokens, k) if k > 0 else []

    @staticmethod
    def allowed(seq, draft: list[int]) -> list[int]:
        """A proposal cut at the first token ``seq``'s grammar forbids."""
        return seq.grammar.allowed_prefix(draft) if draft and seq.grammar is not None else draft
