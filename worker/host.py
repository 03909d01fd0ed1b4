"""The host room: what becomes of a step's tokens, off the MLX thread.

The MLX loop hands each step's events here (``after_step``), in step order, on the host thread
(``mlxq.worker.hostwork``): they become text (detokenizing, stop strings), deltas and results
(``emit``, ``finish``), and one ``StepOutput`` a step goes to the publisher thread.  Nothing here
calls MLX.  A sequence a stop string ended leaves the engine on the MLX thread, before its next step
(``remove_soon``).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from functools import partial
from typing import Optional

from ..shared import codec
from ..shared.schemas import INTERNAL_ERROR, INVALID_REQUEST, MAX_N, Delta, Result
from .jobs import ActiveJob, sample_uid
from .publisher import Publisher, StepOutput
from .stats import Observers, WorkerStats

log = logging.getLogger(__name__)


class Host:
    def __init__(self, active: dict[str, ActiveJob], ready, engine, publisher: Publisher, stats: WorkerStats,
                 observers: Observers, eos, inline: bool):
        # By engine uid (a job with n > 1 has one per sample). Added by the MLX thread (admit), ended here.
        self.active = active
        self.ready = ready  # a preempted sample of a job with n > 1 goes back to it
        self.engine = engine  # (remove only, and only inline: then this runs on the MLX thread)
        self.publisher = publisher
        self.stats = stats
        self.observers = observers
        self.eos = set(eos)
        self.inline = inline
        self.removals: deque[str] = deque()  # -> MLX thread: sequences a stop string ended
        # by uid: (job, text, token ids, logprobs) of this step not yet in a delta.  A step can give a
        # sequence several tokens (speculative decoding): they go out as one delta, as one token does
        self._held: dict[str, tuple[ActiveJob, str, list[int], Optional[list]]] = {}

    def remove_soon(self, uid: str) -> None:
        """Drop a sequence from the engine (on the MLX thread, before its next step)."""
        if self.inline:
            self.engine.remove([uid])
        else:
            self.removals.append(uid)

    def take_removals(self) -> list[str]:
        """MLX thread: the sequences to drop before the next step."""
        uids = []
        while self.removals:
            uids.append(self.removals.popleft())
        return uids

    def after_step(self, events, preempted, tops) -> None:
        """A step's tokens become text, deltas and results, handed to the publisher."""
        out = StepOutput()
        for ev, top in zip(events, tops):
            job = self.active.get(ev.uid)
            if job is None:
                continue
            # this job's own trouble (a parser, a detokenizer): its own end
            self._alone(job, out, partial(self._take_event, job, ev, top, out))
        self._emit_held(out)
        for p in preempted:
            job = self.active.get(p.uid)
            if job is not None and job.group is not None:
                # a sample of a job with n > 1 goes back to the ready queue: admit hands it to the
                # engine again, from the tokens it published (its siblings run on, the job keeps its lease)
                self.ready.put(job)
                continue
            self.active.pop(p.uid, None)
            if job is not None:
                job.tokens = list(p.tokens)
                out.requeues.append((job.id, job.owner, job.resume_state()))
                self.stats.count("requeued")
        self.publisher.publish(out)

    def finish_done(self, jobs: list[ActiveJob]) -> None:
        """End jobs whose every token an earlier attempt published."""
        out = StepOutput()
        for job in jobs:
            self._alone(job, out, lambda j=job: self.finish(j, "length", out, j.text.finish()))
        self.publisher.publish(out)

    def end_by_control(self, kind: str, ended: list) -> None:
        """End cancelled and timed-out jobs (every sample), drop jobs whose lease another worker took
        (after the tokens of every earlier step; a sample finished meanwhile stays finished)."""
        out = StepOutput()
        for job, running in ended:
            if running and self.active.get(job.uid) is not job:
                continue
            if kind == "cancel":
                self._alone(job, out, partial(self.finish, job, "cancelled", out))
            elif kind == "timeout":  # its tokens so far, and the text they make (nothing held back)
                self._alone(job, out, lambda j=job: self.finish(j, "timeout", out, j.text.finish()))
            else:  # lost lease: another worker owns the job now; write nothing
                self.active.pop(job.uid, None)
                log.warning("job=%s attempt=%d dropped: lease lost", job.uid, job.attempt)
        self.publisher.publish(out)

    def _take_event(self, job: ActiveJob, ev, top, out: StepOutput) -> None:
        """One sequence's token (or its end) of a step: text, a delta or the job's result."""
        if job.first_token_at is None:
            job.first_token_at = job.now()
        if ev.cached_tokens is not None:  # prefix-cache hit tokens (engines that know)
            job.cached_tokens = min(ev.cached_tokens, len(job.prompt))
        job.drafts = (job.drafts[0] + ev.draft_proposed, job.drafts[1] + ev.draft_accepted)
        finish = ev.finish_reason
        ids: list[int] = []
        text = ""
        lp = None
        if ev.embedding is not None:  # an embedding job: its vector ends it
            job.embedding = codec.pack_vector(ev.embedding)
            self.finish(job, "stop", out)
            return
        if ev.token is None:  # the engine ended the job with no token: its constraint failed
            self.finish(job, finish or "error", out, job.text.finish(), error=ev.error,
                        error_code=INVALID_REQUEST)
            return
        if not (finish == "stop" and ev.token in self.eos):
            self.observers.notify("on_token", job, 1, time.monotonic())
            ids = [ev.token]
            job.tokens.append(ev.token)
            self.stats.tokens_generated += 1
            text = job.text.add(ev.token)
            if job.request.logprobs:
                lp = [top or {"token": ev.token, "logprob": None, "top": []}]
                job.logprobs.extend(lp)
        if job.text.stopped:  # a stop string, also on the token that reached max_tokens
            if finish is None:
                self.remove_soon(job.uid)
            finish = "stop"
        if finish:
            text += job.text.finish()
            self.finish(job, finish, out, text, ids, lp)
        elif text or ids:
            self._held[job.uid] = (job, *self._unheld(job, text, ids, lp))

    def _unheld(self, job: ActiveJob, text: str, ids, lp: Optional[list]) -> tuple[str, list[int], Optional[list]]:
        """``text``, ``ids`` and ``lp`` after what this step holds for ``job`` (taken out of ``_held``)."""
        held = self._held.pop(job.uid, None)
        if held is None or held[0] is not job:
            return text, list(ids), lp
        _, held_text, held_ids, held_lp = held
        return (held_text + text, held_ids + list(ids),
                None if lp is None and held_lp is None else (held_lp or []) + (lp or []))

    def _emit_held(self, out: StepOutput) -> None:
        """Each running sequence's tokens of this step, as one delta."""
        while self._held:
            job, text, ids, lp = self._held.pop(next(iter(self._held)))
            if self.active.get(job.uid) is job:
                self._alone(job, out, lambda: out.add_delta(job.id, job.owner,
                                                            job.wire_dict(job.emit(text, ids, logprobs=lp))))

    def _alone(self, job: ActiveJob, out: StepOutput, handle) -> None:
        """``handle()``, one job's part of a step; what it raises ends that job alone."""
        try:
            handle()
        except Exception as exc:
            self._fail_alone(job, out, exc)

    def _fail_alone(self, job: ActiveJob, out: StepOutput, exc: BaseException) -> None:
        """Handling one job's step raised. That job ends with an internal error (out of the engine
        too), and the rest of the step goes on. Where even ending it fails, it goes back to the queue
        with this error (the attempt counts; after max_attempts it is dead-lettered)."""
        error = f"internal error in the worker's host step: {type(exc).__name__}: {exc}"[:1000]
        log.exception("job=%s attempt=%d: %s", job.uid, job.attempt, error)
        self.remove_soon(job.uid)
        try:
            self.finish(job, "error", out, error=error, error_code=INTERNAL_ERROR)
        except Exception:
            log.exception("job=%s: ending it failed too; it goes back to the queue", job.uid)
            for sample in self._samples(job.id):  # this job too, unless finish took it out already
                self.active.pop(sample.uid, None)
                self.remove_soon(sample.uid)
            out.abandons.append((job.id, job.owner, error))

    def _samples(self, job_id: str) -> list[ActiveJob]:
        """The job's active sequences: the job itself (n == 1), or its samples still running."""
        job = self.active.get(job_id)
        if job is not None:
            return [job]
        return [s for i in range(MAX_N) if (s := self.active.get(sample_uid(job_id, i))) is not None]

    def finish(self, job: ActiveJob, finish: str, out: StepOutput, text: str = "", ids=(), lp=None,
               error: Optional[str] = None, error_code: Optional[str] = None) -> None:
        if finish == "length" and job.text.stopped:
            # the caller's final flush completed a stop string (text held back as an incomplete
            # character decodes only then): the job ended on it, as on any other stop string
            finish = "stop"
        text, ids, lp = self._unheld(job, text, ids, lp)  # this step's tokens before its last go out with it
        delta = job.emit(text, ids, finish, error, lp)
        self.active.pop(job.uid, None)
        result = job.end(finish, error, error_code)
        if result is None:  # other samples of the job still run: this one's last delta is a delta
            out.add_delta(job.id, job.owner, job.wire_dict(delta))
            return
        packed = result.record()
        if len(packed) > codec.MAX_MESSAGE_BYTES:
            result, delta, packed = _too_large(job, result, delta, len(packed))
        status = {"cancelled": "cancelled", "error": "failed"}.get(result.finish_reason, "done")
        usage = (result.stats.prompt_tokens or 0, result.stats.generated_tokens or 0)
        out.completions.append((job.id, job.owner, status, packed, job.wire(delta), usage))
        self.stats.finished(status)
        self.observers.notify("on_finish", job, result)
        log.info("job=%s attempt=%d finished: %s, %d tokens", job.id, job.attempt, finish, len(job.tokens))


def _too_large(job: ActiveJob, result: Result, delta: Delta, size: int) -> tuple[Result, Delta, bytes]:
    """A result larger than any reader takes (``codec.MAX_MESSAGE_BYTES``: every token's
    log-probabilities of a long job with many samples) ends the job with an error that says so, and
    its final delta with it, rather than a "done" the caller then cannot read. Its stream still holds
    every token that went out."""
    limit = codec.MAX_MESSAGE_BYTES
    error = (f"the result is {size:,} bytes, over the {limit:,} a result may be "
             f"(n {job.request.n}, {len(job.tokens)} tokens a sample"
             + (f", {job.request.logprobs} log-probabilities a token" if job.request.logprobs else "")
             + "): ask for fewer tokens, samples or log-probabilities, or read the stream")
    log.warning("job=%s: %s", job.id, error)
    failed = Result(id=result.id, finish_reason="error", error=error, error_code=INVALID_REQUEST,
                    stats=result.stats)
    delta = delta.model_copy(update={"finish_reason": "error", "error": error})
    return failed, delta, failed.record()
