"""Per-request samplers and logits processors, honoured inside a batch.

A sampled (temperature > 0) job draws from its own key stream: the key of
step ``n`` is a hash of ``(seed, n)``.  So a seeded job gives the same tokens
alone or in any batch, and a preempted job resumes its stream at step ``n``.
"""

from __future__ import annotations

import secrets

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_logits_processors

from mlxq.shared.schemas import SamplingParams
from .engine_api import LogitsProcessor, Sampler

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def step_key(seed: int, step: int) -> mx.array:
    return mx.random.key(_splitmix64(seed ^ _splitmix64(step)) >> 1)


def resolve_seed(params: SamplingParams) -> int:
    """The seed a job samples with: its own, or a fresh one recorded in its stats."""
    return params.seed if params.seed is not None else secrets.randbits(63)


def make_sampler(params: SamplingParams, seed: int, start_step: int = 0) -> Sampler | None:
    """None for greedy jobs (they share one batched argmax)."""
    if params.greedy:
        return None
    filters = []
    if 0.0 < params.top_p < 1.0:
        filters.append(lambda x: apply_top_p(x, params.top_p))
    if params.min_p > 0.0:
        filters.append(lambda x: apply_min_p(x, params.min_p, 1))
    if params.top_k > 0:
        filters.append(lambda x: apply_top_k(x, params.top_k))
    inv_temp = 1.0 / params.temperature
    step = start_step

    def sampler(logprobs: mx.array) -> mx.array:
        nonlocal step
        for f in filters:
            logprobs = f(logprobs)
        key = step_key(seed, step)
        step += 1
        return mx.random.categorical(logprobs * inv_temp, key=key)

    return sampler


def make_processors(params: SamplingParams) -> list[LogitsProcessor]:
    if params.repetition_penalty is None or params.repetition_penalty == 1.0:
        return []
    return make_logits_processors(repetition_penalty=params.repetition_penalty)
