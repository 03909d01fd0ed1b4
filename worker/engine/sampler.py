"""Sampling: a job's sampler from its params, and a batch sampled with one argmax for greedy rows
and per-request samplers for the others.

``sample`` turns a pass's logits (B, vocab) into tokens; rows that share a
sampling configuration are sampled in one call.  A sampled (temperature > 0)
job draws from its own stream of uniforms: the draw of step ``n`` is a hash of
``(seed, sample index, n)`` (sample 0's draws are those of a one-sample job), and
the token is the inverse CDF of softmax(logits / temperature) at it.  So a seeded
job gives the same tokens alone or in any batch, each of its n samples its own,
and a preempted job resumes its stream at step ``n``.

Inverse CDF, not Gumbel-max: it needs one uniform per row instead of a random
vocabulary's worth, and no logarithms; the CPU extension's ``categorical`` op
does it with an 8-lane exp (the x86-64 mlx wheel's exp and log run one float at
a time).
Where the extension is not loaded (a Metal GPU, a failed build) the same draw is
made with MLX ops (softmax, cumsum); both give the same token but where the
draw falls within rounding of a boundary between two tokens.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Optional, Sequence

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from ...shared.schemas import SamplingParams

_MASK64 = (1 << 64) - 1
REPETITION_CONTEXT = 20  # mlx-lm's repetition_context_size default


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def step_hash(seed: int, step: int, sample: int = 0) -> int:
    """The 64-bit hash of (seed, step, sample index) a draw comes from."""
    x = seed ^ _splitmix64(step)
    if sample:  # sample 0 keeps the one-sample draws
        x ^= _splitmix64(_splitmix64(sample) ^ step)
    return _splitmix64(x)


def step_uniform(seed: int, step: int, sample: int = 0) -> float:
    """The draw of step ``step``: a float32-exact uniform in [0, 1) (24 bits of the hash)."""
    return (step_hash(seed, step, sample) >> 40) * (1.0 / (1 << 24))


_ext = None  # the CPU extension, once looked up (False: not loaded)


def _extension_op(name: str):
    """The extension's op ``name`` on the CPU device, else None (a GPU, no extension)."""
    global _ext
    if _ext is None:
        from .attention import cpu_extension
        from .kernels.extbuild import ExtensionUnavailable

        try:  # never builds here: the engine built it at start, or it is not used
            _ext = cpu_extension(build_if_missing=False)
        except ExtensionUnavailable:
            _ext = False
    if not _ext or mx.default_device() != mx.cpu:
        return None
    return getattr(_ext, name, None)


def greedy(logits: mx.array) -> mx.array:
    """(B,) argmax of each row: the first of equal maxima, as mx.argmax (the extension's 8-lane
    loop for float32 on the CPU; MLX's compares one float at a time)."""
    op = _extension_op("argmax") if logits.dtype == mx.float32 and logits.ndim == 2 else None
    return op(logits) if op else mx.argmax(logits, axis=-1)


def categorical(logits: mx.array, inv_temp: mx.array, u: mx.array) -> mx.array:
    """(B,) tokens: row b drawn from softmax(logits[b] * inv_temp[b]) at its uniform u[b]
    (the smallest index whose cumulative probability exceeds it); -inf logits never."""
    op = _extension_op("categorical")
    if op:
        return op(logits.astype(mx.float32), inv_temp, u)
    probs = mx.softmax(logits.astype(mx.float32) * inv_temp[:, None], axis=-1)
    cdf = mx.cumsum(probs, axis=-1)
    idx = (cdf <= u[:, None] * cdf[:, -1:]).sum(axis=-1)
    last = logits.shape[-1] - 1 - mx.argmax((probs > 0)[:, ::-1], axis=-1)  # the last drawable index
    return mx.minimum(idx, last).astype(mx.uint32)


class RowSampler:
    """One job's sampler: filters, temperature and its own key stream.

    The engine samples every row that shares a ``config`` in one call
    (``sample_rows``); each row still draws from its own key, so a job's tokens
    do not depend on the batch it runs in.  Calling it on one row's
    log-probabilities (1, vocab) does the same for that row alone.
    """

    def __init__(self, params: SamplingParams, seed: int, start_step: int = 0, sample: int = 0):
        self.top_p = params.top_p if 0.0 < params.top_p < 1.0 else None
        self.min_p = params.min_p if params.min_p > 0.0 else None
        self.top_k = params.top_k if params.top_k > 0 else None
        if params.greedy:  # temperature under GREEDY_BELOW: 1 / temperature would overflow float32
            raise ValueError(f"temperature {params.temperature!r} samples greedily: no RowSampler (make_sampler)")
        self.inv_temp = 1.0 / params.temperature
        self.config = (self.top_p, self.min_p, self.top_k, self.inv_temp)
        self.seed = seed
        self.sample = sample  # the sample index of an n > 1 job
        self.step = start_step

    @property
    def filters(self) -> bool:
        """Whether a filter (top-p, min-p, top-k) needs the row's log-probabilities."""
        return self.top_p is not None or self.min_p is not None or self.top_k is not None

    def next_uniform(self) -> float:
        u = step_uniform(self.seed, self.step, self.sample)
        self.step += 1
        return u

    def __call__(self, logprobs: mx.array) -> mx.array:
        return sample_rows(logprobs, [self])


def resolve_seed(params: SamplingParams) -> int:
    """The seed a job samples with: its own, or a fresh one recorded in its stats."""
    return params.seed if params.seed is not None else secrets.randbits(63)


def make_sampler(params: SamplingParams, seed: int, start_step: int = 0, sample: int = 0) -> Optional[RowSampler]:
    """None for greedy jobs (they share one batched argmax); ``sample``: the job's sample index."""
    if params.greedy:
        return None
    return RowSampler(params, seed, start_step, sample=sample)


def repetition_penalty(params: SamplingParams) -> Optional[float]:
    """The job's repetition penalty (None: off); ``sample`` applies it to all such rows at once."""
    if params.repetition_penalty is None or params.repetition_penalty == 1.0:
        return None
    return params.repetition_penalty


def sample_rows(logprobs: mx.array, samplers: list[RowSampler]) -> mx.array:
    """Sample (B, vocab) log-probabilities (or logits, when no sampler has a filter: a row's
    constant offset changes no draw); every sampler shares samplers[0].config."""
    s = samplers[0]
    if s.top_p is not None:
        logprobs = apply_top_p(logprobs, s.top_p)
    if s.min_p is not None:
        logprobs = apply_min_p(logprobs, s.min_p, 1)
    if s.top_k is not None and s.top_k < logprobs.shape[-1]:  # k >= the vocabulary keeps every token
        logprobs = apply_top_k(logprobs, s.top_k)
    inv_temp = mx.full((len(samplers),), s.inv_temp, dtype=mx.float32)
    u = mx.array([r.next_uniform() for r in samplers], dtype=mx.float32)
    return categorical(logprobs, inv_temp, u)


@dataclass
class SampleRow:
    """What sampling needs to know about one row."""

    sampler: object  # None (greedy), a RowSampler, or any callable (1, V) logprobs -> (1,)
    processors: Sequence  # logits processors (ctx, logits) -> logits
    context: Optional[mx.array]  # token context for processors (built only when there are some)
    want_logprobs: bool
    repetition: Optional[tuple[float, Sequence]] = None  # (penalty, the last context tokens)


def sample(logits: mx.array, rows: list[SampleRow], bias: Optional[mx.array] = None):
    """Tokens (B,) for each row, and per-row log-probabilities (None where not asked).

    Greedy rows share one argmax; sampled rows that share a configuration
    are sampled in one call (each row from its own key); log-probabilities
    (a logsumexp over the vocabulary) only for rows that ask for them or
    whose sampler needs them.  ``bias`` (B, vocab), added after the logits
    processors: grammar masks (-inf), penalties and logit_bias (0 in rows
    without any).  Everything returned is lazy.
    """
    B = logits.shape[0]
    if any(r.processors for r in rows):
        parts = []
        for i, r in enumerate(rows):
            x = logits[i:i + 1]
            for proc in r.processors:
                x = proc(r.context, x)
            parts.append(x)
        logits = mx.concatenate(parts, axis=0)
    if any(r.repetition for r in rows):
        logits = _repetition_penalty(logits, rows)
    if bias is not None:
        logits = logits + bias.astype(logits.dtype)
    # log-probabilities: for rows that ask for them and for samplers that filter by them
    need_lp = [r.want_logprobs or (r.sampler is not None and
                                   (not isinstance(r.sampler, RowSampler) or r.sampler.filters))
               for r in rows]
    logprobs = None
    if any(need_lp):
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    if all(r.sampler is None for r in rows):
        toks = greedy(logits)
    else:
        toks = _sample_mixed(logits, logprobs, rows)
    lps = [logprobs[i] if rows[i].want_logprobs else None for i in range(B)]
    return toks, lps


def _repetition_penalty(logits: mx.array, rows: list[SampleRow]) -> mx.array:
    """mlx-lm's repetition penalty for every row that has one, in one gather and one scatter over
    the batch: each of a row's last ``REPETITION_CONTEXT`` context tokens' logit is multiplied
    (negative) or divided (positive) by its penalty.  A short context repeats its first token (a
    duplicate index writes the same value); a row without a penalty has penalty 1 (unchanged)."""
    ctx, pen = [], []
    for r in rows:
        toks = list(r.repetition[1])[-REPETITION_CONTEXT:] if r.repetition else [0]
        ctx.append([toks[0]] * (REPETITION_CONTEXT - len(toks)) + toks)
        pen.append(r.repetition[0] if r.repetition else 1.0)
    ctx_a = mx.array(ctx, dtype=mx.int32)
    pen_a = mx.array(pen, dtype=logits.dtype)[:, None]
    sel = mx.take_along_axis(logits, ctx_a, axis=1)
    sel = mx.where(sel < 0, sel * pen_a, sel / pen_a)
    return mx.put_along_axis(logits, ctx_a, sel, axis=1)


def _sample_mixed(logits, logprobs, rows: list[SampleRow]) -> mx.array:
    groups: dict = {}
    for i, r in enumerate(rows):
        if r.sampler is None:
            continue
        key = r.sampler.config if isinstance(r.sampler, RowSampler) else ("callable", i)
        groups.setdefault(key, []).append(i)
    index, values = [], []
    for key, idx in groups.items():
        first = rows[idx[0]].sampler
        src = logits if isinstance(first, RowSampler) and not first.filters else logprobs
        sub = src[mx.array(idx)] if len(idx) < len(rows) else src
        if isinstance(first, RowSampler):
            values.append(sample_rows(sub, [rows[i].sampler for i in idx]).astype(mx.uint32))
        else:
            values.append(first(sub).reshape(-1).astype(mx.uint32))
        index.extend(idx)
    if len(values) == 1 and len(index) == len(rows):
        return values[0]  # every row sampled alike (e.g. the n samples of one job): no argmax
    toks = greedy(logits)
    toks[mx.array(index, dtype=mx.int32)] = mx.concatenate(values).astype(toks.dtype)
    return toks
