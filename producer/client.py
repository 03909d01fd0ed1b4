"""The synchronous producer client: ``Client`` and ``Job``."""

from __future__ import annotations

import threading
import time
from typing import Any, Iterator, Optional

from redis.exceptions import NoPermissionError

from ..shared import apikeys, codec
from ..shared.connection import LINK_ERRORS, LinkWatch, connect as shared_connect, is_cluster, nodes_tried, \
    refresh_topology
from ..shared.keys import GlobalKeys, ModelKeys
from ..shared.protocol import Enqueued, Queue
from ..shared.schemas import Delta, Result
from ..shared.settings import Settings
from .common import (JobTimeout, StreamState, build_request, check_fits, decode_registry, entry_delta,
                     known_model, pick_model, registry_unreadable, result_from_hash, status_text)
from .subscriber import SYNC, Subscriber, get, new_inbox


def connect(url: Optional[str], wait_s: Optional[float] = None):
    """A Redis client from a URL (redis://, rediss:// for TLS, unix://; user:password@ for ACL;
    the URL of any node of a Redis Cluster, or several: ``redis://h1:7000,h2:7001/0``).
    See ``mlxq.shared.connection``."""
    return shared_connect(url, wait_s=wait_s)


class Job:
    """A submitted job. ``stream()`` yields deltas; ``result()`` waits for the final result."""

    def __init__(self, client: "Client", job_id: str, keys: ModelKeys, pubsub, enqueued: Enqueued):
        self.id = job_id
        self._client = client
        self._keys = keys
        self._pubsub = pubsub  # this job's inbox on the client's shared subscriber, or None
        self.enqueued = enqueued
        self._state = StreamState()
        self._last_id = "0-0"
        self._result: Optional[Result] = None
        self._streaming = False  # a stream() is reading the subscription

    def __repr__(self) -> str:
        return f"Job({self.id!r})"

    @property
    def duplicate(self) -> bool:
        """True when an idempotency key matched an earlier submission (same job returned)."""
        return self.enqueued.status == "duplicate"

    def _replay(self) -> list[Delta]:
        r = self._client.redis
        out: list[Delta] = []
        entries = r.xrange(self._keys.events(self.id), min=f"({self._last_id}" if self._last_id != "0-0" else "-")
        for entry_id, fields in entries:
            self._last_id = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
            out.extend(self._state.feed(entry_delta(fields)))
        return out

    def stream(self, timeout: Optional[float] = None) -> Iterator[Delta]:
        """Deltas in order, each once; a late subscriber still gets the whole text.

        A lost link (a Redis restart, a failover) is a pause: the job resubscribes and reads
        what it missed from its durable record.  Past ``timeout``: ``JobTimeout``, or
        ``RedisUnreachable`` (a ``ConnectionError``) while no Redis node answers."""
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.05
        self._streaming = True
        try:
            while not self._state.done:
                self._client._check_deadline(deadline, f"job {self.id} did not finish within {timeout}s")
                try:
                    batch = self._next_batch()
                except _LINK_ERRORS as exc:
                    delay = self._client.watch.backoff(exc, deadline, delay)
                    continue
                delay = 0.05
                self._client.watch.ok()
                yield from batch
        finally:
            self._streaming = False
            if self._state.done:
                self._close_pubsub()

    def _next_batch(self) -> list[Delta]:
        """The next deltas: the durable record when (re)subscribed, quiet, told to (``SYNC``: the
        link was lost meanwhile) or a gap shows; else the live message."""
        if self._pubsub is None:
            self._ensure_pubsub()
            return self._replay()
        data = get(self._pubsub, timeout=1.0)
        if data is None or data == SYNC:
            return self._replay()
        out = feed_message(self._state, data)
        return out + self._replay() if self._state.gap else out

    def result(self, timeout: Optional[float] = None) -> Result:
        """Wait for the final result (kept in Redis: it survives disconnects).

        It waits on the job's done list (one entry when the job ends), not on its
        token channel, so a result-only caller costs nothing per generated token.
        Links are retried as in ``stream``, within ``timeout``.
        """
        if self._result is not None:
            return self._result
        if not self._streaming:  # a result-only caller needs no token stream
            self._close_pubsub()
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.05
        while self._result is None:
            self._client._check_deadline(deadline, f"job {self.id} did not finish within {timeout}s")
            try:
                self._result = self._poll_result(deadline)
            except _LINK_ERRORS as exc:
                delay = self._client.watch.backoff(exc, deadline, delay)
                continue
            delay = 0.05
            self._client.watch.ok()
        return self._result

    def _poll_result(self, deadline: Optional[float]) -> Optional[Result]:
        """The result if the job ended, else None after waiting up to a second for it to end."""
        r = self._client.redis
        res = result_from_hash(self.id, r.hgetall(self._keys.job(self.id)))
        if res is None:
            wait = 1.0 if deadline is None else min(1.0, deadline - time.monotonic())
            if wait > 0:
                r.blpop([self._keys.done(self.id)], timeout=max(0.01, wait))
        return res

    def cancel(self) -> str:
        """'cancelled' (was queued), 'cancelling' (leaves the batch at the next step) or the final status."""
        q = self._client.queue_for(self._keys.model)
        return self._client._retry(lambda: q.cancel(self.id))

    def status(self) -> Optional[str]:
        """The job's status: queued, running, done, failed, cancelled, dead; a queued job that no
        live worker can take now reads "queued, no live worker for MODEL"."""
        s = self._client._retry(lambda: self._client.redis.hget(self._keys.job(self.id), "status"))
        s = s.decode() if s else None
        if s != "queued":
            return s
        return status_text(s, self._keys.model, self._client._registry_entry(self._keys.model),
                           self._client.settings.live_worker_s)

    def _ensure_pubsub(self):
        if self._pubsub is None:
            inbox = new_inbox()
            # returns once the server confirmed it: before the record is read (or the job enqueued)
            self._client.subscriber.subscribe(self._keys.channel(self.id), inbox)
            self._pubsub = inbox
        return self._pubsub

    def _close_pubsub(self) -> None:
        if self._pubsub is not None:
            self._pubsub = None
            self._client.subscriber.unsubscribe(self._keys.channel(self.id))

    def __del__(self):
        try:
            self._close_pubsub()
        except Exception:
            pass


_LINK_ERRORS = LINK_ERRORS


def feed_message(state: StreamState, data: bytes) -> list[Delta]:
    """The deltas a live pub/sub message adds to ``state`` (none for a malformed one)."""
    try:
        delta = Delta.from_wire(codec.unpack(data))
    except (codec.CodecError, ValueError, TypeError):
        return []
    return state.feed(delta)


def check_deadline(watch: LinkWatch, deadline: Optional[float], message: str) -> None:
    """Past ``deadline``: ``RedisUnreachable`` naming the nodes while the links are down, else
    ``JobTimeout(message)``."""
    if deadline is not None and time.monotonic() > deadline:
        if watch.down:
            raise watch.unreachable()
        raise JobTimeout(message)


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
        self._queues: dict[str, Queue] = {}
        cluster = is_cluster(self.redis)
        self.watch = LinkWatch("mlxq client", lambda: nodes_tried(self.redis),
                               (lambda: refresh_topology(self.redis)) if cluster else None)
        self.subscriber = Subscriber(self.redis)  # one pub/sub connection per node for every job's deltas

    def _retry(self, fn, deadline: Optional[float] = None):
        """``fn()``, retried through a lost link for up to ``settings.redis_outage_s``."""
        if deadline is None:
            deadline = time.monotonic() + self.settings.redis_outage_s
        return self.watch.call(fn, deadline)

    def _check_deadline(self, deadline: Optional[float], message: str) -> None:
        check_deadline(self.watch, deadline, message)

    # -- model and tier ---------------------------------------------------------
    def models(self) -> dict[str, dict]:
        """Models served by workers (name -> info)."""
        return decode_registry(self._retry(lambda: self.redis.hgetall(self.gkeys.models)))

    def _registry(self) -> Optional[dict[str, dict]]:
        """``models()``, or None for a Redis user that may not read the registry (ACL)."""
        try:
            return self.models()
        except NoPermissionError as exc:
            registry_unreadable(exc)
            return None

    def _registry_entry(self, model: str) -> Optional[dict]:
        registry = self._registry()
        return None if registry is None else registry.get(model, {})

    @property
    def model(self) -> str:
        with self._lock:
            if self._model is None:
                self._model = pick_model(None, self.models())
            return self._model

    @property
    def key_hash(self) -> Optional[str]:
        """What enqueue sends: sha256 of the API key (the tier is decided in Redis from it)."""
        return apikeys.key_hash(self.api_key) if self.api_key is not None else None

    def tier(self, floor: Optional[str] = None) -> str:
        """The tier the admin's registry gives this client's key (informational, and a 401 before
        a bulk run; enqueue decides again in Redis).  Needs read access to the global registry."""
        return self._retry(lambda: apikeys.resolve_tier(self.redis, self.gkeys.api_keys, self.api_key, floor))

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

        Sampling params: max_tokens, temperature, top_p, top_k, min_p,
        repetition_penalty, seed, stop, logprobs.
        """
        model = model or self.model
        req = build_request(model, dict(prompt=prompt, messages=messages, prompt_tokens=prompt_tokens,
                                        session_id=session_id, source=_source, submitted_at=time.time(), **params))
        check_fits(req, known_model(model, self._registry()))  # NoModelError at once for an unknown model
        payload = codec.pack(req.model_dump(mode="json", exclude_none=True))
        if len(payload) > self.settings.max_prompt_bytes:
            raise ValueError(f"request of {len(payload)} bytes exceeds the {self.settings.max_prompt_bytes}-byte limit")
        q = self.queue_for(model)
        job = Job(self, req.id, q.keys, None, None)
        deadline = time.monotonic() + self.settings.redis_outage_s
        if subscribe:
            self._retry(job._ensure_pubsub, deadline)  # subscribed (and confirmed) before the job exists
        try:
            # the same request under the same id: a retry after a lost reply is the same job
            enq = self._retry(lambda: q.enqueue(req.id, payload, self.key_hash, _floor, idempotency_key,
                                                global_redis=self.redis), deadline)
        except Exception:
            job._close_pubsub()
            raise
        if enq.status == "duplicate":
            job._close_pubsub()
            return Job(self, enq.job_id, q.keys, None, enq)
        job.enqueued = enq
        return job

    def job(self, job_id: str, model: Optional[str] = None) -> Job:
        """A handle on an existing job (e.g. from another process)."""
        keys = self.gkeys.model_keys(model or self.model)
        return Job(self, job_id, keys, None, Enqueued("existing", job_id, None, None))

    def close(self) -> None:
        self.subscriber.close()
        self.redis.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def map(self, items, **params: Any) -> Iterator[Result]:
        """Submit many prompts (strings or dicts of submit arguments) at the low tier; yield their
        Results in input order.  Options: window= (jobs kept queued, default 64), timeout=,
        idempotency_prefix=; other params are defaults for every item.  See ``mlxq.producer.bulk``."""
        from .bulk import map_results

        return map_results(self, items, **params)
