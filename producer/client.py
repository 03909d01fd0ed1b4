"""The synchronous producer client: ``Client`` and ``Job``."""

from __future__ import annotations

import threading
import time
from typing import Any, Iterator, Optional, Union

from redis.exceptions import NoPermissionError

from ..shared import apikeys
from ..shared.connection import connect as shared_connect, nodes_tried
from ..shared.keys import GlobalKeys
from ..shared.linkwatch import LinkWatch
from ..shared.protocol import Enqueued, Queue
from ..shared.schemas import Delta, Result
from ..shared.settings import Settings
from ..shared.slots import is_cluster, refresh_topology
from ..shared.steps import Steps, drive, run_steps
from .bulkmap import map_results
from .registry import decode_registry, known_model, pick_model, registry_unreadable, status_text
from .core import (REPLAY_FIELDS, SYNC, EmbedInput, Emit, Enqueue, JobHandle, Origin, Pause, Receive, Resubmit,
                   WaitDone, decode_status, embed_answer, embed_jobs, embed_kwargs, prepare, retryable, schema_of,
                   submission, submit_kwargs)
from .subscriber import Subscriber, get, new_inbox


def connect(url: Optional[str], wait_s: Optional[float] = None):
    """A Redis client from a URL (redis://, rediss:// for TLS, unix://; user:password@ for ACL;
    the URL of any node of a Redis Cluster, or several: ``redis://h1:7000,h2:7001/0``).
    See ``mlxq.shared.connection``."""
    return shared_connect(url, wait_s=wait_s)


class Job(JobHandle):
    """A submitted job. ``stream()`` yields deltas; ``result()`` waits for the final result.

    What to read when, and what a lost link or a timeout means, is decided by the client core
    (``mlxq.producer.core.JobCore``); this class does the reads it asks for."""

    def stream(self, timeout: Optional[float] = None) -> Iterator[Delta]:
        """Deltas in order, each once; a late subscriber still gets the whole text.

        A lost link (a Redis restart, a failover) is a pause: the job resubscribes and reads
        what it missed from its durable record.  Past ``timeout``: ``JobTimeout``, or
        ``RedisUnreachable`` (a ``ConnectionError``) while no Redis node answers; with no
        ``timeout`` too, ``RedisUnreachable`` once no node has answered for ``settings.redis_outage_s``
        (``MLXQ_REDIS_OUTAGE_S``, 30 s).  ``ClientClosed`` once the client is closed."""
        self._streaming = True
        try:
            yield from self._drive(Steps(self._core.stream(timeout)))
        finally:
            self._streaming = False
            # left early too (a break): unsubscribe; a later stream() subscribes again and replays
            # what it missed from the durable record
            self._close_pubsub()

    def result(self, timeout: Optional[float] = None) -> Result:
        """Wait for the final result (kept in Redis: it survives disconnects).

        It waits on the job's done list (one entry when the job ends), not on its
        token channel, so a result-only caller costs nothing per generated token.
        Links are retried as in ``stream``, within ``timeout``.  A job submitted with
        ``response_format=`` a pydantic class gives a result with ``parsed``/``parse_error``.
        """
        if self._core.result is not None:
            return self._core.result
        if not self._streaming:  # a result-only caller needs no token stream
            self._close_pubsub()
        steps = Steps(self._core.wait_result(timeout))
        for _ in self._drive(steps):
            pass
        return steps.value

    def _drive(self, steps: Steps) -> Iterator[Delta]:
        """Do each read the core asks for; yield the deltas it emits."""
        handlers = self._handlers()
        for _ in drive(steps, lambda op: handlers[type(op)](op), Emit):
            pending = self._core.undelivered
            while pending:  # one at a time: a caller that leaves keeps the rest for its next stream()
                yield pending.popleft()

    # -- the reads of the core's requests ---------------------------------------------------------
    def _io_receive(self, op: Receive) -> Optional[bytes]:
        if self._pubsub is None:
            self._ensure_pubsub(op.confirm_s)
            return SYNC
        return get(self._pubsub, timeout=op.seconds)

    def _io_read_events(self, op) -> list:
        return self._client.redis.xrange(self._keys.events(self.id), min=self._core.replay_from())

    def _io_read_replay(self, op) -> list:
        return self._client.redis.hmget(self._keys.job(self.id), *REPLAY_FIELDS)

    def _io_read_record(self, op) -> dict:
        return self._client.redis.hgetall(self._keys.job(self.id))

    def _io_wait_done(self, op: WaitDone) -> None:
        self._client.redis.blpop([self._keys.done(self.id)], timeout=op.seconds)

    def _io_pause(self, op: Pause) -> None:
        self._client.watch.backoff(op.error, op.deadline, op.backoff, retryable)

    def _io_resubmit(self, op: Resubmit) -> str:
        origin = self._core.origin
        job_id, payload = origin.again(op.resume_ids)
        enq = self._client.retry(lambda: self._client._enqueue(Enqueue(self._keys.model, job_id, payload, origin.floor,
                                                                        origin.idempotency_key)))
        self._close_pubsub()  # the next read subscribes the new job's channel and reads its record
        return enq.job_id

    def cancel(self) -> str:
        """'cancelled' (was queued), 'cancelling' (leaves the batch at the next step) or the final status."""
        return self._client.retry(lambda: self._client._cancel(self._keys.model, self.id))

    def status(self) -> Optional[str]:
        """The job's status: queued, running, done, failed, cancelled, dead, expired; a queued job that no
        live worker can take now reads "queued, no live worker for MODEL"."""
        s = decode_status(self._client.retry(lambda: self._client.redis.hget(self._keys.job(self.id), "status")))
        if s != "queued":
            return s
        return status_text(s, self._keys.model, self._client.model_info(self._keys.model),
                           self._client.settings.live_worker_s)

    def _ensure_pubsub(self, confirm_s: Optional[float] = None):
        if self._pubsub is None:
            inbox = new_inbox()
            # returns once the server confirmed it: before the record is read (or the job enqueued)
            self._client.subscriber.subscribe(self._keys.channel(self.id), inbox, confirm_s)
            self._pubsub = inbox
        return self._pubsub

    def _close_pubsub(self) -> None:
        if self._pubsub is not None:
            inbox, self._pubsub = self._pubsub, None
            self._client.subscriber.unsubscribe(self._keys.channel(self.id), inbox)

    def __del__(self):
        try:
            self._close_pubsub()
        except Exception:
            pass


class Client:
    """Submit generation jobs to mlxq workers through Redis.

    The tier comes from ``api_key`` (assigned by an admin with ``mlxq keys add``);
    no key means normal, an unknown or revoked key is refused.
    """

    def __init__(self, redis_url: Optional[str] = None, api_key: Optional[str] = None,
                 model: Optional[str] = None, *, settings: Optional[Settings] = None, redis_client=None):
        self.settings = settings or Settings.from_env()
        self.redis = redis_client or connect(redis_url or self.settings.redis_url, self.settings.redis_outage_s)
        self.api_key = api_key
        self._model = model
        self.gkeys = GlobalKeys(self.settings.prefix)
        # Every shared resource is made here or under _lock (threads share a Client), and a lost
        # link is rebuilt by the one subscriber reader that saw it fail (see subscriber.py).
        self._lock = threading.RLock()
        self.closed = False  # set by close(): every job's wait then raises ClientClosed
        self._queues: dict[str, Queue] = {}
        cluster = is_cluster(self.redis)
        # a wait with no timeout ends too: RedisUnreachable once the links stayed down redis_outage_s
        self.watch = LinkWatch("mlxq client", lambda: nodes_tried(self.redis),
                               (lambda: refresh_topology(self.redis)) if cluster else None,
                               give_up_s=self.settings.redis_outage_s, give_up_timed=False)
        self.subscriber = Subscriber(self.redis)  # one pub/sub connection per node for every job's deltas

    def retry(self, fn, deadline: Optional[float] = None):
        """``fn()``, retried through a lost link for up to ``settings.redis_outage_s``.
        Public for code that reads or writes a job's own keys beside the client (``client.at(key)``),
        as the gateway's Responses room does with its stored response."""
        if deadline is None:
            deadline = time.monotonic() + self.settings.redis_outage_s
        return self.watch.call(fn, deadline, is_link=retryable)

    # -- model and tier ---------------------------------------------------------
    def models(self) -> dict[str, dict]:
        """Models served by workers (name -> info)."""
        return decode_registry(self.retry(lambda: self.redis.hgetall(self.gkeys.models)))

    def _registry(self) -> Optional[dict[str, dict]]:
        """``models()``, or None for a Redis user that may not read the registry (ACL)."""
        try:
            return self.models()
        except NoPermissionError as exc:
            registry_unreadable(exc)
            return None

    def model_info(self, model: str) -> Optional[dict]:
        """One model's entry in the workers' registry (as ``models()`` gives it): {} when no worker
        registered it, None when this Redis user may not read the registry (ACL)."""
        registry = self._registry()
        return None if registry is None else registry.get(model, {})

    @property
    def model(self) -> str:
        """The model this client submits to when none is given: the one passed in, else its settings' ``model``
        (``MLXQ_MODEL``),
        else the only one workers serve (``NoModelError`` when that is not one).  ``AsyncClient.model``
        is the same, awaited."""
        with self._lock:
            if self._model is None:
                self._model = pick_model(self.settings.model, self.models())
            return self._model

    @property
    def key_hash(self) -> Optional[str]:
        """What enqueue sends: sha256 of the API key (the tier is decided in Redis from it)."""
        return apikeys.key_hash(self.api_key) if self.api_key is not None else None

    def tier(self, floor: Optional[str] = None) -> str:
        """The tier the admin's registry gives this client's key (informational, and a 401 before
        a bulk run; enqueue decides again in Redis).  Needs read access to the global registry."""
        return self.retry(lambda: apikeys.resolve_tier(self.redis, self.gkeys.api_keys, self.api_key, floor))

    def queue_for(self, model: str) -> Queue:
        with self._lock:
            if model not in self._queues:
                self._queues[model] = Queue(self.redis, self.gkeys.model_keys(model), self.settings)
            return self._queues[model]

    # -- submit -----------------------------------------------------------------
    def submit(self, prompt: Optional[str] = None, *, messages: Optional[list] = None,
               prompt_tokens: Optional[list[int]] = None, model: Optional[str] = None,
               idempotency_key: Optional[str] = None, session_id: Optional[str] = None,
               subscribe: bool = True, _floor: Optional[str] = None, _source: str = "client",
               **params: Any) -> Job:
        """Validate, subscribe to the job's channel, then enqueue. Returns a :class:`Job`.

        ``subscribe=False`` (bulk paths) holds no pub/sub connection per pending job:
        ``stream()``/``result()`` subscribe when called and replay the durable record.

        Sampling params: max_tokens, temperature, top_p, top_k, min_p, repetition_penalty,
        presence_penalty, frequency_penalty, logit_bias, seed, stop, logprobs.  Output: tools,
        tool_choice, parallel_tool_calls, response_format (a dict, or a pydantic model class: the
        result then carries ``parsed``, the validated instance, or ``parse_error``).

        A job's life (docs/pipelines/job-life.md): ``run_at`` (epoch seconds) or ``defer_s`` queue it
        later; ``expires_at`` or ``expires_in`` end it ``expired`` (never run) if no worker started it
        by then (its result: finish_reason "error", error "expired: ..."); ``webhook`` names a URL (on
        the operator's ``webhook_hosts``) that is POSTed a signed summary when it ends.
        """
        model = model or self.model
        prep = prepare(model, submit_kwargs(prompt, messages, prompt_tokens, session_id, _source, params),
                       known_model(model, self._registry()), self.settings.max_prompt_bytes, settings=self.settings)
        keys = self.gkeys.model_keys(model)
        origin = Origin.of(prep, _floor, idempotency_key)
        job = Job(self, prep.request.id, keys, None, None, prep.schema, origin)
        io = job._submit_handlers(time.monotonic() + self.settings.redis_outage_s)
        enq = run_steps(submission(model, prep, _floor, idempotency_key, subscribe), lambda op: io[type(op)](op))
        if enq.status == "duplicate":
            return Job(self, enq.job_id, keys, None, enq, prep.schema, origin)
        job.enqueued = enq
        return job

    def embed(self, input: EmbedInput, *, model: Optional[str] = None, dimensions: Optional[int] = None,
              pooling: Optional[str] = None, normalize: bool = True, timeout: Optional[float] = None,
              _floor: Optional[str] = None) -> Union[list[float], list[list[float]]]:
        """Embed a text (or one list of token ids): its vector; or a list of them: a vector each, in
        order.  Each input is one embedding job (the worker batches them); ``dimensions`` keeps the
        first this many values, renormalised; ``pooling`` "last" or "mean" (default: the worker's
        rule).  Every input is validated before any is queued; ``EmbeddingFailed`` if a job fails."""
        model = model or self.model
        jobs, single = embed_jobs(model, input, embed_kwargs(dimensions, pooling, normalize),
                                  known_model(model, self._registry()), self.settings.max_prompt_bytes)
        handles = [self.submit(model=model, _floor=_floor, **kw) for kw in jobs]
        return embed_answer([h.result(timeout) for h in handles], single)

    def _enqueue(self, op: Enqueue) -> Enqueued:
        return self.queue_for(op.model).enqueue(op.job_id, op.payload, self.key_hash, op.floor, op.idempotency_key,
                                                global_redis=self.redis)

    def _cancel(self, model: str, job_id: str) -> str:
        return self.queue_for(model).cancel(job_id)

    def job(self, job_id: str, model: Optional[str] = None, response_format=None, *,
            _origin: Optional[Origin] = None) -> Job:
        """A handle on an existing job (e.g. from another process); ``response_format`` its pydantic
        class, for ``parsed`` on its result.  (``_origin``: the request, from the caller that
        submitted it, to submit it again if its record is lost: ``map``.)"""
        keys = self.gkeys.model_keys(model or self.model)
        return Job(self, job_id, keys, None, Enqueued("existing", job_id, None, None), schema_of(response_format),
                   _origin)

    def close(self) -> None:
        """Close the links; a ``result()`` or ``stream()`` waiting in another thread raises
        ``ClientClosed``."""
        self.closed = True
        self.subscriber.close()
        self.redis.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def map(self, items, **params: Any) -> Iterator[Result]:
        """Submit many prompts (strings or dicts of submit arguments) at the low tier; yield their
        Results in input order.  Options: window= (jobs kept queued, default 64), timeout=,
        idempotency_prefix=; other params are defaults for every item.  Left before its end, it cancels
        the jobs it still had queued, unless an idempotency_prefix lets a later call find them.

        ``webhook=`` (a URL on the operator's ``webhook_hosts``, checked before anything is queued) is
        per run, not per job: when the map ends, one signed POST (the webhook sender's, as a job's)
        carries ``map.completed`` (every item yielded), ``map.cancelled`` (left before its end) or
        ``map.failed`` (it raised), with ``request_counts`` of the Results yielded.  See
        ``mlxq.producer.bulkmap``."""
        return map_results(self, items, **params)
