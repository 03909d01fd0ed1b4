"""A job's seed, sampler and repetition penalty, from its sampling params (the engine samples with them)."""

from __future__ import annotations

import secrets
from typing import Optional

from ..shared.schemas import SamplingParams
from .engine.sampler import RowSampler


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

