"""A job's sampler and logits processors, built from its sampling params (the engine samples with them)."""

from __future__ import annotations

import secrets
from typing import Optional

from mlx_lm.sample_utils import make_logits_processors

from ..shared.schemas import SamplingParams
from .engine.sampler import RowSampler
from .engine.api import LogitsProcessor


def resolve_seed(params: SamplingParams) -> int:
    """The seed a job samples with: its own, or a fresh one recorded in its stats."""
    return params.seed if params.seed is not None else secrets.randbits(63)


def make_sampler(params: SamplingParams, seed: int, start_step: int = 0, sample: int = 0) -> Optional[RowSampler]:
    """None for greedy jobs (they share one batched argmax); ``sample``: the job's sample index."""
    if params.greedy:
        return None
    return RowSampler(params, seed, start_step, sample=sample)


def repetition_penalty(params: SamplingParams) -> Optional[float]:
    """The job's repetition penalty (None: off); the engine applies it to all such rows at once."""
    if params.repetition_penalty is None or params.repetition_penalty == 1.0:
        return None
    return params.repetition_penalty


def make_processors(params: SamplingParams) -> list[LogitsProcessor]:
    """mlx-lm's logits processors for these params (references, and engines driven without specs'
    batched penalties)."""
    if repetition_penalty(params) is None:
        return []
    return make_logits_processors(repetition_penalty=params.repetition_penalty)
