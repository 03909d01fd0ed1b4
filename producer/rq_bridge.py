"""rq interop: RAG pipelines already on rq enqueue generation with plain rq.

    from rq import Queue
    job = Queue("mlxq-low", connection=r).enqueue("mlxq.generate", prompt="...", max_tokens=64)
    job.latest_result().return_value   # {"id", "text", "token_ids", "finish_reason", "error", "usage", ...}

Two ways to run such jobs:

* ``mlxq worker --rq-queues mlxq-high,mlxq-normal,mlxq-low`` runs an :class:`RqBridge` beside the
  worker: one thread moves rq jobs into mlxq's sorted-set queue (tier from the rq queue name), another
  mirrors each job's end back into rq's own records (status, registries, ``Result``) with rq's API.
* An ordinary ``rq worker mlxq-low`` runs :func:`generate` itself: it submits through the mlxq
  ``Client`` and waits for the result.

Either way the mlxq job is enqueued with the idempotency key ``rq:<rq job id>``: a job moved twice
(a crash between steps) runs once.

rq stores a job's call as a pickle.  mlxq never unpickles arbitrary objects: :class:`SafePickle`
loads pickles that hold only plain values (str, int, float, bool, None, list, tuple, dict, bytes)
and refuses any class or function reference.  Results are written as rq's default serializer
expects (a pickle of a plain dict), so ``return_value()`` works with no special setup.
"""

from __future__ import annotations

import io
import logging
import os
import pickle
import threading
from dataclasses import dataclass
from typing import Any, Optional

from rq.defaults import DEFAULT_FAILURE_TTL, DEFAULT_RESULT_TTL
from rq.exceptions import DeserializationError, NoSuchJobError
from rq.job import Job as RqJob, JobStatus
from rq.queue import Queue as RqQueue
from rq.executions import Execution
from rq.registry import CanceledJobRegistry
from rq.results import Result as RqResult
from rq.utils import now as rq_now, utcformat

from ..shared import codec
from ..shared.apikeys import AuthError
from ..shared.keys import GlobalKeys
from ..shared.protocol import JobRefused, OverloadError
from ..shared.schemas import Result
from ..shared.settings import TIERS, Settings

log = logging.getLogger(__name__)

FUNC_PATH = "mlxq.generate"
DEFAULT_QUEUES = ("mlxq-high", "mlxq-normal", "mlxq-low")
DEFAULT_TIER = "low"
WAIT_TIMEOUT_S = 3600.0  # how long generate() under a plain rq worker waits for its result


class SafePickle:
    """An rq serializer that loads only plain-value pickles (no classes, no functions)."""

    @staticmethod
    def dumps(obj: Any) -> bytes:
        return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)

    @staticmethod
    def loads(data: bytes) -> Any:
        return _PlainUnpickler(io.BytesIO(data)).load()


class _PlainUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}: only plain values are accepted")


def tier_for_queue(queue_name: Optional[str]) -> str:
    """mlxq-high -> high, mlxq-normal -> normal, mlxq-low -> low; any other queue -> low."""
    if queue_name and queue_name.startswith("mlxq-"):
        tier = queue_name[len("mlxq-"):]
        if tier in TIERS:
            return tier
    return DEFAULT_TIER


def result_payload(res: Result) -> dict:
    """What rq sees as the return value: mlxq's Result as plain values, plus OpenAI-style usage."""
    out = res.model_dump(mode="json", exclude={"logprobs"} if res.logprobs is None else set())
    out["usage"] = res.usage.model_dump()  # prompt, completion, total and cached tokens
    return out


def enqueue_generation(client, kwargs: dict, tier: str, idempotency_key: Optional[str]):
    """Validate an rq job's kwargs as a generation request and put it on the mlxq queue.

    ValueError: the request is invalid; OverloadError: the tier's queue is full."""
    from .bulkmap import enqueue_request

    return enqueue_request(client, kwargs, tier, idempotency_key, source="rq")


def generate(prompt: Optional[str] = None, **kwargs: Any) -> dict:
    """The rq job function.  Under a plain ``rq worker`` it submits through the mlxq Client and
    waits; jobs on mlxq-* queues taken by an mlxq worker's bridge never run this function.

    kwargs: messages=, prompt_tokens=, model= and the sampling params of ``Client.submit``."""
    from rq import get_current_job

    from .client import Client

    rq_job = get_current_job()
    settings = Settings.from_env()
    if rq_job is not None:
        # the bridge's own key, as under a worker's --rq-queues (the queue name is a floor on its tier)
        client = Client(settings=settings, redis_client=rq_job.connection, api_key=settings.rq_api_key)
        tier, idem = tier_for_queue(rq_job.origin), f"rq:{rq_job.id}"
    else:  # called directly: the caller's own key, as the CLI takes it
        client = Client(settings=settings, api_key=settings.api_key)
        tier, idem = client.tier(DEFAULT_TIER), None
    enq = enqueue_generation(client, {"prompt": prompt, **kwargs}, tier, idem)
    log.info("job=%s attempt=%d submitted for rq job %s", enq.job_id, 0, rq_job.id if rq_job else "-")
    res = client.job(enq.job_id, enq.model).result(timeout=WAIT_TIMEOUT_S)
    if res.finish_reason == "error":
        raise RuntimeError(f"mlxq job {enq.job_id} failed: {res.error}")
    return result_payload(res)


@dataclass
class Pending:
    """A bridged job whose end is not yet mirrored into rq."""

    rq_id: str
    model: str
    job_id: str


class RqBridge:
    """Moves rq jobs into mlxq's queue and mirrors their end back into rq's records.

    Run it beside a Worker: ``bridge.start()``; pass it in ``Worker(observers=[bridge])`` so a
    finishing job wakes the mirror at once (it also polls).  Crash safety: a job moves
    rq queue -> intake list (atomic LMOVE) -> mlxq queue + pending hash -> out of intake; every
    step is repeatable (the idempotency key ``rq:<id>`` stops a second enqueue).
    """

    def __init__(self, redis_client, model: str, settings: Optional[Settings] = None,
                 queues: tuple[str, ...] = DEFAULT_QUEUES, *, worker_name: Optional[str] = None,
                 poll_s: float = 0.5, api_key: Optional[str] = None):
        from .client import Client

        self.redis = redis_client
        self.settings = settings or Settings.from_env()
        # rq queue names (mlxq-high, ...) are floors on the tier of the bridge's own key (MLXQ_RQ_API_KEY)
        self.client = Client(settings=self.settings, redis_client=redis_client, model=model,
                             api_key=api_key or self.settings.rq_api_key)
        self.model = model
        self.queues = [RqQueue(name, connection=redis_client, serializer=SafePickle) for name in queues]
        self.gkeys = GlobalKeys(self.settings.prefix)
        self.worker_name = worker_name or f"mlxq-bridge-{os.getpid()}"
        self.poll_s = poll_s
        self.stop_event = threading.Event()
        self._wake = threading.Event()
        self._threads: list[threading.Thread] = []
        self.moved = 0
        self.mirrored = 0

    # -- lifecycle ---------------------------------------------------------------
    def start(self) -> "RqBridge":
        for name, target in (("rq-mover", self._move_loop), ("rq-mirror", self._mirror_loop)):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)
        log.info("rq bridge: taking jobs from %s into model %r", [q.name for q in self.queues], self.model)
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self.stop_event.set()
        self._wake.set()
        for t in self._threads:
            t.join(timeout)

    # Worker observer: called on the MLX thread; only sets an event.
    def on_finish(self, job, result) -> None:
        self._wake.set()

    # -- rq -> mlxq ----------------------------------------------------------------
    def _move_loop(self) -> None:
        while not self.stop_event.is_set():
            try:
                busy = self.move_once()
            except Exception:
                log.exception("rq bridge: moving jobs failed; retrying")
                busy = False
            if not busy:
                self.stop_event.wait(self.poll_s)

    def move_once(self) -> bool:
        """Handle the intake's oldest job, else take one from the rq queues. True if it did work."""
        intake = self.gkeys.rq_intake
        head = self.redis.lindex(intake, 0)
        if head is None:
            for q in self.queues:  # in priority order
                head = self.redis.lmove(q.key, intake, "LEFT", "RIGHT")
                if head is not None:
                    break
            if head is None:
                return False
        rq_id = head.decode()
        try:
            self._bridge(rq_id)
        except OverloadError as exc:
            log.warning("rq job %s waits: %s", rq_id, exc)
            self.stop_event.wait(1.0)
            return False
        self.redis.lrem(intake, 1, rq_id)
        return True

    def _bridge(self, rq_id: str) -> None:
        try:
            rq_job = RqJob.fetch(rq_id, connection=self.redis, serializer=SafePickle)
        except NoSuchJobError:
            log.warning("rq job %s vanished before it was bridged", rq_id)
            return
        if rq_job.get_status(refresh=False) in (JobStatus.CANCELED, JobStatus.STOPPED):
            return
        try:
            func_name, kwargs = rq_job.func_name, rq_job.kwargs
            if func_name != FUNC_PATH:
                raise ValueError(f"mlxq rq queues run only {FUNC_PATH}, not {func_name}")
            callbacks = [name for name in ("success", "failure", "stopped")
                         if getattr(rq_job, f"_{name}_callback_name", None)]
            if callbacks:  # the bridge runs no code named by the queue (it unpickles with SafePickle)
                raise ValueError(f"mlxq does not run rq callbacks (on_{', on_'.join(callbacks)}): enqueue a job "
                                 "with depends_on=<this job> to act on its result")
            if rq_job.args:
                kwargs = {"prompt": rq_job.args[0], **kwargs} if len(rq_job.args) == 1 else None
                if kwargs is None:
                    raise ValueError("generate() takes the prompt as its only positional argument")
            enq = enqueue_generation(self.client, kwargs, tier_for_queue(rq_job.origin), f"rq:{rq_id}")
        except (DeserializationError, ValueError, AuthError, JobRefused) as exc:
            # refused for good: an rq caller waits on this job's status, and it stayed in the intake,
            # ahead of every job after it, where the error was not one of these (an AuthError)
            log.warning("rq job %s refused: %s", rq_id, exc)
            self._mirror_failure(rq_job, f"mlxq refused the job: {exc}")
            return
        pending = {"model": enq.model, "job": enq.job_id}
        rq_job.meta["mlxq_job_id"] = enq.job_id
        with self.redis.pipeline() as pipe:
            pipe.hset(self.gkeys.rq_pending, rq_id, codec.pack(pending))
            rq_job.prepare_for_execution(self.worker_name, pipeline=pipe)
            # "executing" in rq info until mirrored; the +inf score keeps rq's cleanup from failing it
            rq_job.started_job_registry.add_execution(self._execution(rq_id, enq.job_id), pipe, ttl=-1)
            pipe.execute()
        rq_job.save_meta()
        self.moved += 1
        log.info("job=%s attempt=%d enqueued from rq job %s (%s, tier %s)", enq.job_id, 0, rq_id,
                 rq_job.origin, tier_for_queue(rq_job.origin))

    # -- mlxq -> rq ----------------------------------------------------------------
    def _mirror_loop(self) -> None:
        while not self.stop_event.is_set():
            self._wake.wait(self.poll_s)
            self._wake.clear()
            try:
                self.mirror_once()
            except Exception:
                log.exception("rq bridge: mirroring results failed; retrying")

    def pending(self) -> list[Pending]:
        out = []
        for rq_id, blob in self.redis.hgetall(self.gkeys.rq_pending).items():
            try:
                d = codec.unpack(blob)
                out.append(Pending(rq_id.decode(), d["model"], d["job"]))
            except (codec.CodecError, KeyError, TypeError):
                self.redis.hdel(self.gkeys.rq_pending, rq_id)
        return out

    def mirror_once(self) -> int:
        """Mirror every pending job that has ended; cancel in mlxq what was cancelled in rq."""
        from .records import result_from_hash

        items = self.pending()
        if not items:
            return 0
        with self.redis.pipeline(transaction=False) as pipe:
            for p in items:
                pipe.hgetall(self.gkeys.model_keys(p.model).job(p.job_id))
                pipe.hget(RqJob.key_for(p.rq_id), "status")
            replies = pipe.execute()
        done = 0
        for i, p in enumerate(items):
            job_hash, rq_status = replies[2 * i], replies[2 * i + 1]
            if rq_status is None:  # the rq job was deleted: nobody waits for it
                self.redis.hdel(self.gkeys.rq_pending, p.rq_id)
                continue
            if not job_hash:  # the mlxq record is gone: the rq job would stay "started" forever
                self._mirror_gone(p, rq_status.decode())
                done += 1
                continue
            res = result_from_hash(p.job_id, job_hash)
            if res is None:
                if rq_status.decode() in (JobStatus.CANCELED.value, JobStatus.STOPPED.value):
                    status = self.client.queue_for(p.model).cancel(p.job_id)
                    log.info("job=%s attempt=%d cancel from rq: %s", p.job_id, 0, status)
                continue
            self._mirror_result(p, res)
            done += 1
        return done

    def _mirror_gone(self, p: Pending, rq_status: str) -> None:
        """The job's mlxq record no longer exists (it is written before the job is pending here, so it
        expired, e.g. its result TTL ran out while the bridge was down, or it was deleted): its result
        cannot be read any more, so the rq job fails with a message saying so, or ends cancelled if it
        was cancelled in rq."""
        rq_job = self._rq_job(p)
        if rq_job is None:
            return
        if rq_status in (JobStatus.CANCELED.value, JobStatus.STOPPED.value):
            self._mirror_cancel(rq_job)
        else:
            self._mirror_failure(rq_job, f"mlxq job {p.job_id}: its record in Redis is gone (expired before the "
                                         "bridge read its result, or deleted); its result is lost")
        log.warning("job=%s attempt=%d record gone before it was mirrored into rq job %s", p.job_id, 0, p.rq_id)

    def _rq_job(self, p: Pending) -> Optional[RqJob]:
        """The rq job ``p`` mirrors into, or None (and it is pending no more) once rq deleted it."""
        try:
            return RqJob.fetch(p.rq_id, connection=self.redis, serializer=SafePickle)
        except NoSuchJobError:
            self.redis.hdel(self.gkeys.rq_pending, p.rq_id)
            return None

    def _mirror_result(self, p: Pending, res: Result) -> None:
        rq_job = self._rq_job(p)
        if rq_job is None:
            return
        if res.finish_reason not in ("error", "cancelled"):  # stop, length, tool_calls: an answer
            self._mirror_success(rq_job, result_payload(res))
        elif res.finish_reason == "cancelled":
            self._mirror_cancel(rq_job)
        else:
            self._mirror_failure(rq_job, f"mlxq job {p.job_id} failed: {res.error}")
        self.mirrored += 1
        log.info("job=%s attempt=%d mirrored into rq job %s: %s", p.job_id, res.stats.attempts, p.rq_id,
                 res.finish_reason)

    def _execution(self, rq_id: str, job_id: str) -> Execution:
        """The bridged run, as an rq execution id (the mlxq job id), for the started registry."""
        return Execution(job_id, rq_id, self.redis, worker_name=self.worker_name)

    def _ended(self, rq_job: RqJob, pipe) -> None:
        rq_job.ended_at = rq_now()
        pipe.hset(rq_job.key, "ended_at", utcformat(rq_job.ended_at))
        pipe.hdel(self.gkeys.rq_pending, rq_job.id)
        job_id = rq_job.meta.get("mlxq_job_id")
        if job_id:
            rq_job.started_job_registry.remove_execution(self._execution(rq_job.id, job_id), pipeline=pipe)

    def _mirror_success(self, rq_job: RqJob, value: dict) -> None:
        ttl = rq_job.get_result_ttl(DEFAULT_RESULT_TTL)
        with self.redis.pipeline() as pipe:
            rq_job.set_status(JobStatus.FINISHED, pipeline=pipe)
            self._ended(rq_job, pipe)
            if ttl != 0:
                RqResult.create(rq_job, RqResult.Type.SUCCESSFUL, ttl=ttl, return_value=value,
                                worker_name=self.worker_name, pipeline=pipe)
                rq_job.finished_job_registry.add(rq_job, ttl, pipe)
            rq_job.cleanup(ttl, pipeline=pipe)
            pipe.execute()
        self._release_dependents(rq_job)

    def _mirror_failure(self, rq_job: RqJob, message: str) -> None:
        ttl = rq_job.failure_ttl or DEFAULT_FAILURE_TTL
        with self.redis.pipeline() as pipe:
            rq_job.set_status(JobStatus.FAILED, pipeline=pipe)
            self._ended(rq_job, pipe)
            rq_job.failed_job_registry.add(rq_job, ttl=ttl, exc_string=message, pipeline=pipe)
            RqResult.create_failure(rq_job, ttl, exc_string=message, worker_name=self.worker_name, pipeline=pipe)
            pipe.execute()
        self._release_dependents(rq_job)  # those that allow a failed dependency (rq's worker does the same)

    def _release_dependents(self, rq_job: RqJob) -> None:
        """Enqueue the jobs that depend on this one and may now run (rq's ``depends_on``), as rq's worker
        does when a job ends: they stayed deferred forever. Their data is not unpickled here."""
        try:
            RqQueue(rq_job.origin, connection=self.redis, serializer=SafePickle).enqueue_dependents(rq_job)
        except Exception:  # noqa: BLE001 - the job's own end is recorded; rq's registry cleanup can retry
            log.exception("rq job %s: enqueueing the jobs that depend on it failed", rq_job.id)

    def _mirror_cancel(self, rq_job: RqJob) -> None:
        with self.redis.pipeline() as pipe:
            rq_job.set_status(JobStatus.CANCELED, pipeline=pipe)
            self._ended(rq_job, pipe)
            CanceledJobRegistry(rq_job.origin, connection=self.redis, serializer=SafePickle).add(rq_job, pipeline=pipe)
            pipe.execute()
