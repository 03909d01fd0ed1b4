"""What the clients raise (beside pydantic's ``ValueError`` for a bad request and ``RedisUnreachable``)."""

from __future__ import annotations

import redis

# raised by the enqueue reply itself (shared.protocol.parse_enqueue, which Client and AsyncClient share):
# the key's daily token quota is used up; ``retry_after_s`` says when the next day's begins
from ..shared.protocol import QuotaExceeded  # noqa: F401  (the clients' error, named here with the others)


class NoModelError(LookupError):
    """No model given and none could be chosen, or the one given is served by no worker."""


class JobTimeout(TimeoutError):
    pass


class ConfirmCut(redis.TimeoutError):
    """A subscription's confirmation not waited for to its end: the caller's deadline came first. Not a
    lost link (the job's wait ends with ``JobTimeout``, not ``RedisUnreachable``)."""


class ClientClosed(RuntimeError):
    """The client was closed (``close()`` / ``aclose()``) before or while one of its jobs' waits ran:
    ``result()`` and ``stream()`` raise it, in every thread or task waiting on them."""


class JobNotFound(LookupError):
    """The job has no record in Redis: an id no producer submitted (on this model), or a job whose
    record expired (``result_ttl_s`` after it ended). Its stream and result can never come."""

    def __init__(self, job_id: str):
        super().__init__(f"job {job_id} is unknown, or its record expired (results are kept for result_ttl_s)")
        self.job_id = job_id


class ContextLengthError(ValueError):
    """A prompt longer than the model's context (OpenAI's ``context_length_exceeded``)."""


class EmbeddingFailed(RuntimeError):
    """An embedding job ended without its vector (``result``: its Result, with the worker's error)."""

    def __init__(self, result):
        super().__init__(f"embedding job {result.id} failed: {result.error or result.finish_reason}")
        self.result = result
