"""Per-row logit shaping on the host: grammar masks (llguidance), OpenAI penalties, logit_bias.

No MLX here: everything is numpy and llguidance.  ``RowGrammar`` follows one
constrained sequence (an ``llguidance.LLMatcher`` fed every token the sequence
emits); ``shape`` turns a batch's rows into one additive (B, vocab) float32
matrix (0 where a token is free, -inf where the grammar forbids it, minus the
penalties, plus logit_bias) that the model runner adds to the logits, or None when
no row needs one (the batch keeps the unshaped graph).  The masks of all
constrained rows are computed in one ``fill_next_token_bitmask_par`` call: the
LLExecutor's threads, with the GIL released, while the forward pass runs.  (The grammar
itself comes from the request: ``mlxq.shared.constraints`` compiles its ``response_format``.)
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional, Sequence as Seq

import numpy as np

log = logging.getLogger(__name__)

_TEMPLATES = 64  # compiled matchers kept per engine (deep-copied per sequence)


class GrammarError(ValueError):
    """A sequence's constraint cannot go on; the job ends with "error" and this message."""


def _first_line(error: str) -> str:
    """llguidance's matcher errors carry a state dump after the first line: keep the line."""
    return (error or "").strip().splitlines()[0] if (error or "").strip() else ""


class RowGrammar:
    """One sequence's matcher: fed each token the sequence emits, asked for the next mask."""

    def __init__(self, matcher):
        self.matcher = matcher

    def advance(self, token: int) -> Optional[str]:
        """Consume ``token``; the reason when the grammar refuses it (None: accepted)."""
        if self.matcher.consume_token(token):
            return None
        return f"the constraint refused token {token}: {_first_line(self.matcher.get_error()) or 'not allowed here'}"

    def allowed_prefix(self, tokens: list[int]) -> list[int]:
        """The longest prefix of ``tokens`` the grammar accepts from here (a proposal cut at the first
        token it forbids); the matcher is not moved."""
        return tokens[:self.matcher.validate_tokens(tokens)] if tokens else []

    def after(self, tokens: Seq[int]) -> "RowGrammar":
        """A copy of this matcher past ``tokens`` (which it accepts: an allowed prefix)."""
        row = RowGrammar(self.matcher.deep_copy())
        if tokens:
            row.matcher.consume_tokens(list(tokens))
        return row

    @property
    def stopped(self) -> bool:
        """The grammar is complete and allows nothing more (EOS included): the job ends "stop"."""
        return self.matcher.is_stopped() and not self.matcher.is_error()

    def error(self) -> Optional[str]:
        """Why the matcher is in its error state (one line), or None."""
        if not self.matcher.is_error():
            return None
        return f"the constraint failed: {_first_line(self.matcher.get_error()) or 'matcher error'}"


@dataclass
class Shaped:
    """A batch's logit shaping: ``bias`` (B, width) to add (None: none), ``dead`` rows whose
    grammar allows no token at all, with why."""

    bias: Optional[np.ndarray]
    dead: list[tuple[int, str]]


class GrammarBook:
    """The model's llguidance tokenizer, compiled matchers, and the executor for masks."""

    def __init__(self, tokenizer, eos_token_ids: Seq[int]):
        import llguidance
        import llguidance.hf

        hf = getattr(tokenizer, "_tokenizer", tokenizer)
        self.lltok = llguidance.hf.from_tokenizer(hf, eos_token=list(eos_token_ids) or None)
        self.executor = llguidance.LLExecutor()
        self._llg = llguidance
        self._templates: "OrderedDict[str, object]" = OrderedDict()

    def _template(self, grammar: str):
        m = self._templates.get(grammar)
        if m is None:
            m = self._llg.LLMatcher(self.lltok, grammar, log_level=0)
            if m.is_error():
                raise GrammarError(f"the constraint does not compile for this model: {_first_line(m.get_error())}")
            self._templates[grammar] = m
            if len(self._templates) > _TEMPLATES:
                self._templates.popitem(last=False)
        self._templates.move_to_end(grammar)
        return m

    def start(self, grammar: str, resume_tokens: Seq[int]) -> RowGrammar:
        """A matcher for one sequence, at the state after ``resume_tokens`` (a preempted or
        crashed job resumes exactly where its grammar was)."""
        row = RowGrammar(self._template(grammar).deep_copy())
        if resume_tokens and not row.matcher.consume_tokens(list(resume_tokens)):
            raise GrammarError(f"the constraint refuses the job's earlier tokens: {_first_line(row.matcher.get_error())}")
        return row

    def fill_masks(self, rows: list[tuple[int, RowGrammar]], batch: int) -> np.ndarray:
        """Bitmasks (batch, words) of the given (row index, grammar) pairs, in parallel."""
        import llguidance.numpy as lnp

        masks = lnp.allocate_token_bitmask(batch, self.lltok.vocab_size)
        lnp.fill_next_token_bitmask_par(self.executor, [(g.matcher, i) for i, g in rows], masks)
        return masks


def allowed_from_bitmask(masks: np.ndarray, width: int) -> np.ndarray:
    """(B, words) int32 bitmasks -> (B, width) bool; tokens past the mask's words are forbidden."""
    bits = np.unpackbits(masks.view(np.uint8), axis=1, bitorder="little").astype(bool)
    if bits.shape[1] >= width:
        return bits[:, :width]
    return np.pad(bits, ((0, 0), (0, width - bits.shape[1])))


@dataclass
class RowShape:
    """What shaping one row needs (from its sequence): None / zeros mean "not this kind"."""

    grammar: Optional[RowGrammar]
    generated: Seq[int]
    presence: float = 0.0
    frequency: float = 0.0
    logit_bias: Optional[dict[int, float]] = None

    @property
    def penalized(self) -> bool:
        return bool(self.presence or self.frequency)

    @property
    def shaped(self) -> bool:
        return self.grammar is not None or self.penalized or bool(self.logit_bias)


def shape(rows: list[Optional[RowShape]], width: int, book: Optional[GrammarBook]) -> Shaped:
    """The additive bias of a batch (None when no row is shaped) and its dead-ended rows."""
    if not any(r is not None and r.shaped for r in rows):
        return Shaped(None, [])
    bias = np.zeros((len(rows), width), dtype=np.float32)
    dead = _apply_grammars(bias, rows, book)
    for i, r in enumerate(rows):
        if r is not None:
            _apply_penalties(bias[i], r)
    return Shaped(bias, dead)


def _apply_grammars(bias: np.ndarray, rows: list[Optional[RowShape]], book) -> list[tuple[int, str]]:
    constrained = [(i, r.grammar) for i, r in enumerate(rows) if r is not None and r.grammar is not None]
    if not constrained:
        return []
    allowed = allowed_from_bitmask(book.fill_masks(constrained, len(rows)), bias.shape[1])
    dead = []
    for i, g in constrained:
        err = g.error()
        if err or not allowed[i].any():
            dead.append((i, err or "the constraint dead-ended: no token can continue the output"))
            continue
        bias[i][~allowed[i]] = -np.inf
    return dead


def _apply_penalties(row: np.ndarray, r: RowShape) -> None:
    if r.penalized and len(r.generated):
        counts = np.bincount(np.asarray(r.generated, dtype=np.int64), minlength=row.shape[0])[:row.shape[0]]
        row -= (r.presence * (counts > 0) + r.frequency * counts).astype(np.float32)
    for tok, b in (r.logit_bias or {}).items():
        if 0 <= tok < row.shape[0]:
            row[tok] += b
