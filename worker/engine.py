"""The dense engine: a solo fast path plus mlx-lm's ``BatchGenerator``.

* One sequence alone runs in a single-sequence loop shaped like mlx-lm's
  ``generate_step`` (same prefill chunks, same async pipelining), so solo
  generation is as fast as ``stream_generate``.
* When a second sequence arrives, the solo sequence moves into the
  ``BatchGenerator`` with its KV cache, sampler and token history: nothing is
  recomputed, no token is lost or repeated, and neither job waits.
* Batched sequences join at the next step and leave at once (``remove``).
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Optional

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, StopSequences, generation_stream
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import greedy_sampler

from .engine_api import Preempted, SeqSpec, TokenEvent

log = logging.getLogger(__name__)


@dataclass
class _Solo:
    """The one sequence on the fast path."""

    spec: SeqSpec
    cache: list[Any]
    history: list[int]  # tokens in the cache (prompt + generated so far)
    current: Optional[mx.array] = None  # token sampled last step, not yet returned
    current_logprobs: Optional[mx.array] = None
    generated: int = 0


@dataclass
class EngineCounters:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    steps: int = 0
    solo_steps: int = 0
    migrations: int = 0
    extra: dict = field(default_factory=dict)


class DenseEngine:
    """Implements :class:`mlxq.worker.engine_api.Engine` on mlx-lm's dense caches."""

    def __init__(
        self,
        model,
        *,
        eos_token_ids=(),
        max_batch: int = 64,
        prefill_batch: int = 8,
        prefill_step: int = 2048,
        solo_fast_path: bool = True,
    ):
        self.model = model
        self.max_batch = max_batch
        self.prefill_step = prefill_step
        self.solo_fast_path = solo_fast_path
        self._eos = tuple(eos_token_ids)
        self._gen = BatchGenerator(
            model,
            stop_tokens=[[e] for e in self._eos] or None,
            completion_batch_size=max_batch,
            prefill_batch_size=min(prefill_batch, max_batch),
            prefill_step_size=prefill_step,
        )
        self._pending: deque[SeqSpec] = deque()
        self._solo: Optional[_Solo] = None
        self._uid_to_job: dict[int, str] = {}
        self._job_to_uid: dict[str, int] = {}
        self.counters = EngineCounters()

    # -- Engine protocol ---------------------------------------------------
    def add(self, specs: list[SeqSpec]) -> None:
        self._pending.extend(specs)

    def remove(self, uids: list[str]) -> None:
        uids = set(uids)
        if self._solo is not None and self._solo.spec.uid in uids:
            self._solo = None
        self._pending = deque(s for s in self._pending if s.uid not in uids)
        gone = [self._job_to_uid.pop(u) for u in uids if u in self._job_to_uid]
        for uid in gone:
            del self._uid_to_job[uid]
        if gone:
            self._gen.remove(gone)

    def has_work(self) -> bool:
        return bool(self._pending or self._solo or self._job_to_uid)

    def active(self) -> int:
        return len(self._pending) + (self._solo is not None) + len(self._job_to_uid)

    def free_slots(self) -> int:
        return max(0, self.max_batch - self.active())

    def can_admit(self, prompt_len: int, max_tokens: int) -> bool:
        return True

    def stats(self) -> dict:
        c = self.counters
        return {
            "engine": "dense",
            "engine_steps": c.steps,
            "solo_steps": c.solo_steps,
            "solo_migrations": c.migrations,
            "prompt_tokens": c.prompt_tokens,
        }

    def step(self) -> tuple[list[TokenEvent], list[Preempted]]:
        with mx.stream(generation_stream):
            events = self._step()
        self.counters.steps += 1
        self.counters.generated_tokens += len(events)
        if self.counters.steps % 256 == 0:
            mx.clear_cache()
        return events, []

    # -- internals ---------------------------------------------------------
    def _step(self) -> list[TokenEvent]:
        events: list[TokenEvent] = []
        batched = bool(self._job_to_uid)
        if self._solo is None and not batched and len(self._pending) == 1 and self.solo_fast_path:
            self._start_solo(self._pending.popleft())
        if self._solo is not None and self._pending:
            events += self._migrate_solo()
        if self._solo is not None:
            return events + self._solo_step()
        if self._pending:
            self._insert(list(self._pending))
            self._pending.clear()
        if not self._job_to_uid:
            return events
        _, responses = self._gen.next()
        for r in responses:
            job = self._uid_to_job.get(r.uid)
            if job is None:
                continue
            if r.finish_reason is not None:
                del self._uid_to_job[r.uid]
                del self._job_to_uid[job]
            events.append(TokenEvent(job, r.token, r.finish_reason, r.logprobs))
        return events

    def _stops(self, spec: SeqSpec) -> tuple[int, ...]:
        return self._eos if spec.stop_token_ids is None else tuple(spec.stop_token_ids)

    def _stop_sequences(self, spec: SeqSpec) -> Optional[StopSequences]:
        stops = self._stops(spec)
        if stops == self._eos:
            return None
        return StopSequences([[t] for t in stops] or None)

    def _insert(self, specs: list[SeqSpec]) -> None:
        prompts = [s.prompt + s.resume_tokens for s in specs]
        self.counters.prompt_tokens += sum(len(p) for p in prompts)
        stops = [self._stop_sequences(s) for s in specs]
        uids = self._gen.insert(
            prompts,
            max_tokens=[s.max_tokens for s in specs],
            samplers=[s.sampler for s in specs],
            logits_processors=[s.logits_processors for s in specs],
            stop_sequences=[st or self._gen._default_stop_sequences for st in stops],
        )
        for uid, spec in zip(uids, specs):
            self._uid_to_job[uid] = spec.uid
            self._job_to_uid[spec.uid] = uid

    # -- solo fast path ----------------------------------------------------
    def _solo_forward(self, solo: _Solo, token: mx.array) -> tuple[mx.array, mx.array]:
        """Feed ``token`` (shape (1,)) and sample the next one, lazily."""
        logits = self.model(token[None], cache=solo.cache)[:, -1, :]
        if solo.spec.logits_processors:
            context = mx.concatenate([mx.array(solo.history, dtype=token.dtype), token])
            for processor in solo.spec.logits_processors:
                logits = processor(context, logits)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        sampler = solo.spec.sampler or greedy_sampler
        return sampler(logprobs), logprobs.squeeze(0)

    def _start_solo(self, spec: SeqSpec) -> None:
        prompt = spec.prompt + spec.resume_tokens
        self.counters.prompt_tokens += len(prompt)
        cache = make_prompt_cache(self.model)
        tokens = mx.array(prompt)
        # prefill all but the last token in chunks, exactly as generate_step does
        while tokens.size > 1:
            n = min(self.prefill_step, tokens.size - 1)
            self.model(tokens[:n][None], cache=cache)
            mx.eval([c.state for c in cache])
            tokens = tokens[n:]
            mx.clear_cache()
        solo = _Solo(spec=spec, cache=cache, history=list(prompt[:-1]))
        solo.current, solo.current_logprobs = self._solo_forward(solo, tokens)
        mx.async_eval(solo.current, solo.current_logprobs)
        solo.history.append(prompt[-1])
        self._solo = solo

    def _read_solo_token(self, solo: _Solo, launch_next: bool) -> TokenEvent:
        """Return the token in flight; optionally start the next one before reading it
        (generate_step's overlap: the CPU computes while Python builds the next graph)."""
        token_arr, logprobs = solo.current, solo.current_logprobs
        solo.generated += 1
        last = solo.generated >= solo.spec.max_tokens
        if launch_next and not last:
            solo.current, solo.current_logprobs = self._solo_forward(solo, token_arr)
            mx.async_eval(solo.current, solo.current_logprobs)
        token = token_arr.item()
        finish = "stop" if token in self._stops(solo.spec) else ("length" if last else None)
        return TokenEvent(solo.spec.uid, token, finish, logprobs)

    def _solo_step(self) -> list[TokenEvent]:
        solo = self._solo
        event = self._read_solo_token(solo, launch_next=True)
        solo.history.append(event.token)
        self.counters.solo_steps += 1
        if event.finish_reason:
            self._solo = None  # a speculative next step, if any, is simply dropped
        return [event]

    def _migrate_solo(self) -> list[TokenEvent]:
        """Move the solo sequence into the batch generator with its KV cache.

        The token in flight is emitted now and becomes the sequence's batch input;
        the sampler (with its step counter) and the token history go along.
        """
        solo, self._solo = self._solo, None
        event = self._read_solo_token(solo, launch_next=False)
        if event.finish_reason:
            return [event]
        mx.eval([c.state for c in solo.cache])
        spec = solo.spec
        [uid] = self._gen.insert(
            [[event.token]],
            max_tokens=[spec.max_tokens - solo.generated],
            caches=[solo.cache],
            all_tokens=[solo.history],
            samplers=[spec.sampler],
            logits_processors=[spec.logits_processors],
            stop_sequences=[self._stop_sequences(spec) or self._gen._default_stop_sequences],
        )
        self._uid_to_job[uid] = spec.uid
        self._job_to_uid[spec.uid] = uid
        self.counters.migrations += 1
        return [event]
