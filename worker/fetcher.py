"""The fetcher room: one thread that pulls as many jobs as there are free slots and prepares them
(decodes, validates, tokenizes) off the MLX thread.  When idle it blocks on the queue's wake-up list,
then waits a short window to gather a batch.  Prepared jobs wait in the ``ReadyQueue`` for the MLX
loop; a job refused here ends with its error through the publisher, and never reaches the MLX loop.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Callable, Optional, Protocol

from ..shared import codec
from ..shared.protocol import Pulled, Queue, owner_token
from ..shared.schemas import INTERNAL_ERROR, INVALID_REQUEST, Delta, Result
from .jobs import (ActiveJob, JobError, check_embedding, check_published_ids, check_token_ids, decode_request,
                   job_grammar, prompt_in_thinking, read_samples, seen_output, start_job, tokenize)
from .publisher import StepOutput
from ..shared.linkwatch import Backoff
from .redis_io import REDIS_ERRORS
from .textstream import chat_format

log = logging.getLogger(__name__)


class Capacity(Protocol):
    """What the fetcher asks the MLX loop before a pull (read on the fetcher thread)."""

    def free_slots(self) -> int: ...

    def urgent_below(self) -> float:
        """A queued job scoring below this would preempt a running one (-inf: none would)."""


class ServerClock:
    """Redis server time minus local time, as of the last pull (jobs report server-clock stamps)."""

    offset = 0.0


class Fetcher(threading.Thread):
    """Pulls jobs off the MLX thread. ``prepare`` (a ``Preparer``) turns a Pulled entry into ready items."""

    def __init__(self, q: Queue, worker_id: str, capacity: Capacity, prepare: Callable[[Pulled], None],
                 stop: threading.Event, gather_s: float, idle_block_s: float, clock: Optional[ServerClock] = None,
                 kick: Optional[threading.Event] = None):
        super().__init__(name="mlxq-fetcher", daemon=True)
        self.q = q
        self.worker_id = worker_id
        self.capacity = capacity
        self.prepare = prepare
        self.stop_event = stop
        self.paused = threading.Event()  # set on warm shutdown: pull nothing more
        self.pulling = threading.Lock()  # held from a pull until its jobs are prepared (pause)
        self.gather_s = gather_s
        self.idle_block_s = idle_block_s
        self.kick = kick or threading.Event()  # set by the MLX thread when slots free up
        self.backoff = Backoff()
        self.pulls = 0
        self.clock = clock or ServerClock()
        # job id -> owner: jobs of the pull being prepared, leased here but in no queue of the
        # worker yet; the heartbeat renews them too (a pull of large prompts can take longer to
        # tokenize than a lease lasts, and the reaper would queue jobs this worker goes on to run)
        self.preparing: dict[str, str] = {}

    def run(self) -> None:
        idle = True
        while not self.stop_event.is_set() and not self.paused.is_set():
            try:
                want = self.capacity.free_slots()
                if want <= 0 and self._urgent_waiting():
                    want = 1
                if want <= 0:
                    self.kick.wait(0.05)
                    self.kick.clear()
                    continue
                if idle:
                    # Block on the wake-up signal rather than polling, then gather a batch.
                    woke = self.q.redis.blpop([self.q.keys.wake], timeout=self.idle_block_s)
                    if self.paused.is_set():
                        break
                    if woke and self.gather_s > 0:
                        time.sleep(self.gather_s)
                    want = self.capacity.free_slots()
                    if want <= 0:
                        continue
                with self.pulling:
                    if self.paused.is_set():
                        break
                    local = time.time()
                    pulled = self.q.pull(want, self.worker_id)
                    self.backoff.ok()
                    if pulled:
                        self.clock.offset = pulled[0].now - local
                        self.pulls += 1
                        self.preparing.update({e.job_id: owner_token(self.worker_id, e.attempt)
                                               for e in pulled if e.kind == "job"})
                        try:
                            for entry in pulled:
                                self._prepare_one(entry)
                                self.preparing.pop(entry.job_id, None)
                        finally:
                            self.preparing.clear()
                # Under load (we got a full pull) never wait; otherwise go idle, unless the pull came
                # back short because it dropped stale members and the queue still holds more.
                idle = len(pulled) < want and self.q.redis.zcard(self.q.keys.queue) == 0
            except REDIS_ERRORS as exc:
                delay = self.backoff.fail()
                log.warning("pull failed (%s); retrying in %.2fs", exc, delay)
                time.sleep(delay)
            except Exception:  # never let the fetcher die on one bad entry
                log.exception("fetcher error")
                time.sleep(0.1)

    def _prepare_one(self, entry) -> None:
        """``prepare``, whose failure costs this entry alone, not the rest of its pull: those are
        leased to this worker and, skipped, would wait for their leases to lapse and count an
        attempt. ``prepare`` fails a bad job itself; what still escapes (a bug, or a panic from a
        Rust library, which is a BaseException) leaves this one to its lease."""
        try:
            self.prepare(entry)
        except REDIS_ERRORS:
            raise  # the worker is stopping (prepare retries through lost links until then)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException:
            log.exception("job=%s: preparing it failed; it comes back when its lease lapses", entry.job_id)

    def pause(self, timeout: float = 10.0) -> None:
        """Pull nothing more, and wait until a pull under way has handed its jobs over (``prepare``):
        a job leased but not yet in the ready queue when the worker gives its jobs back would otherwise
        wait for its lease to expire, and then count an attempt it never had."""
        self.paused.set()
        if self.pulling.acquire(timeout=timeout):
            self.pulling.release()
        else:
            log.warning("a pull still under way after %.0fs; its jobs come back when their leases expire", timeout)

    def leases(self) -> dict[str, str]:
        """job id -> owner token of the jobs being prepared (a copy: this thread changes them)."""
        return dict(self.preparing)

    def _urgent_waiting(self) -> bool:
        """True when the head of the queue is urgent enough to preempt a running job here."""
        # while no slot is free: a queued job scoring below urgent_below() would preempt, so pull it
        below = self.capacity.urgent_below()
        if below == float("-inf"):
            return False
        head = self.q.redis.zrange(self.q.keys.queue, 0, 0, withscores=True)
        return bool(head) and head[0][1] < below

def fit_context(req, prompt_len: int, ctx: int) -> None:
    """Hold a job to the model's context of ``ctx`` tokens: a prompt that fills it, or a ``max_tokens``
    the caller gave that the rest of it cannot hold, is refused (:class:`JobError`, as vLLM does);
    the default ``max_tokens`` (the caller gave none) is cut to what the context leaves, so the job
    ends with "length" there."""
    if prompt_len >= ctx:
        raise JobError(f"prompt of {prompt_len} tokens exceeds the model's context of {ctx} tokens")
    if prompt_len + req.max_tokens <= ctx:
        return
    if "max_tokens" in req.model_fields_set:
        raise JobError(f"this model's context is {ctx} tokens; the prompt has {prompt_len} and max_tokens "
                       f"asks for {req.max_tokens} more ({prompt_len + req.max_tokens} in all): lower "
                       f"max_tokens to at most {ctx - prompt_len}, or shorten the prompt")
    req.max_tokens = ctx - prompt_len


class Preparer:
    """Fetcher thread: a pulled entry becomes its job's ready samples (validated, tokenized, resumed
    from what earlier attempts published), or the job's end with an error that says why."""

    def __init__(self, q: Queue, loaded, settings, engine, worker_id: str, ready: "ReadyQueue", publisher,
                 stats, stop: threading.Event, clock: ServerClock):
        self.q = q
        self.loaded = loaded
        self.settings = settings
        self.engine = engine  # (can_admit only: bookkeeping, no MLX)
        self.worker_id = worker_id
        self.ready = ready
        self.publisher = publisher
        self.stats = stats
        self.stop_event = stop
        self.clock = clock
        # the embedding's rows (mlx-lm's model args), which bound the token ids a job may name too
        self.model_vocab: Optional[int] = getattr(getattr(loaded.model, "args", None), "vocab_size", None)
        # an embedding job's pooling when it names none: the worker's setting, else the model's own
        self.pooling = settings.embed_pooling if settings.embed_pooling != "auto" else (loaded.pooling or "last")

    def __call__(self, entry: Pulled) -> None:
        """Validate and tokenize; failures end the job with an error."""
        if entry.kind != "job":
            log.warning("garbage queue member %r moved to the dead-letter set", entry.job_id[:80])
            return
        offset = self.clock.offset
        # outside the try below: reading the record retries through lost links and raises only when the
        # worker stops; that is no fault of the job, which must not be failed for it (its lease brings
        # it back)
        try:
            record = self._record(entry)
        except REDIS_ERRORS:
            raise
        except Exception as exc:  # e.g. the events key holds another type: the record cannot be read
            log.exception("job=%s attempt=%d: reading its durable record failed", entry.job_id, entry.attempt)
            self.publisher.publish(self._failure(entry, f"its durable record cannot be read: {exc}", INTERNAL_ERROR))
            return
        tokenizer, vocab = self.loaded.tokenizer, self.model_vocab
        try:
            req = decode_request(entry, self.loaded.name, self.settings.max_new_tokens)
            prompt = tokenize(req, tokenizer, vocab)
            check_token_ids(req, tokenizer, vocab)
            if req.embed is not None:
                self.ready.put(*self._embedding(entry, req, prompt, offset))
                return
            # whether the prompt opened a reasoning block: read once (a marker of several tokens takes a
            # decode of the whole prompt) for the grammar and every sample's output stream
            thinking = prompt_in_thinking(prompt, chat_format(tokenizer), tokenizer)
            seen = seen_output(req, prompt, tokenizer, thinking)
            published = read_samples(record or [], seen) if record or seen else None
            check_published_ids(published, tokenizer, vocab)
            grammar = job_grammar(req, prompt, tokenizer, thinking)
            fit_context(req, len(prompt), self.loaded.context_length)
            if not self.engine.can_admit(len(prompt), req.max_tokens):
                raise JobError(f"prompt of {len(prompt)} tokens plus max_tokens {req.max_tokens} can never fit "
                               "this worker's KV memory")
            samples = start_job(entry, req, prompt, tokenizer, self.worker_id, offset, published,
                                grammar=grammar, in_thinking=thinking)
        except JobError as exc:
            log.warning("job=%s attempt=%d refused: %s", entry.job_id, entry.attempt, exc)
            self.publisher.publish(self._failure(entry, str(exc), INVALID_REQUEST))
            return
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # a tokenizer bug, or a Rust panic (a BaseException), must not kill the worker
            log.exception("job=%s attempt=%d failed to prepare", entry.job_id, entry.attempt)
            self.publisher.publish(self._failure(entry, f"internal error preparing the job: {exc}", INTERNAL_ERROR))
            return
        self.ready.put(*samples)

    def _embedding(self, entry: Pulled, req, prompt: list[int], offset: float) -> list[ActiveJob]:
        """An embedding job's one sample: prefill only, so nothing of an earlier attempt is resumed."""
        check_embedding(req, len(prompt), self.loaded.context_length, self.loaded.hidden_size)
        if not self.engine.can_admit(len(prompt), 1):
            raise JobError(f"input of {len(prompt)} tokens can never fit this worker's KV memory")
        [job] = start_job(entry, req, prompt, self.loaded.tokenizer, self.worker_id, offset, in_thinking=False)
        job.pooling = req.embed.pooling or self.pooling
        return [job]

    def _record(self, entry: Pulled) -> Optional[list]:
        """What earlier attempts of this job published (its durable record's entries), for a job that
        ran before (a later attempt after a crash, or a preempted or requeued job)."""
        if entry.attempt <= 1 and not entry.resume:
            return None
        backoff = Backoff()
        while True:
            try:
                return self.q.redis.xrange(self.q.keys.events(entry.job_id))
            except REDIS_ERRORS as exc:
                if self.stop_event.is_set():
                    raise
                delay = backoff.fail()
                log.warning("job=%s: reading its durable record failed (%s); retrying in %.2fs",
                            entry.job_id, exc, delay)
                time.sleep(delay)

    def _failure(self, entry: Pulled, message: str, code: str) -> StepOutput:
        owner = owner_token(self.worker_id, entry.attempt)
        result = Result(id=entry.job_id, finish_reason="error", error=message, error_code=code)
        result.stats.queued_at = entry.queued_at
        result.stats.started_at = entry.now
        result.stats.attempts = entry.attempt
        result.stats.worker = self.worker_id
        result.stats.tier = entry.tier
        final = Delta(attempt=entry.attempt, seq=1, finish_reason="error", error=message)
        self.stats.count("failed")
        return StepOutput(completions=[(entry.job_id, owner, "failed", result.record(),
                                        codec.pack(final.to_wire()), (0, 0))])


class ReadyQueue:
    """Prepared jobs waiting for the MLX thread; guarded so slot counts stay exact."""

    def __init__(self):
        self.lock = threading.Lock()
        self.items: deque = deque()
        self.event = threading.Event()

    def put(self, *items) -> None:
        """Items that go together (the samples of a job) arrive together."""
        with self.lock:
            self.items.extend(items)
        self.event.set()

    def __len__(self) -> int:
        return len(self.items)
