"""The models workers serve (the registry, ``GlobalKeys.models``) as producers read it: which model a
submission goes to, whether it exists, and whether a live worker serves it."""

from __future__ import annotations

import logging
import threading
import time
from typing import Optional

from ..shared import codec
from .errors import NoModelError

log = logging.getLogger("mlxq.producer")


def pick_model(explicit: Optional[str], registered: dict[str, dict]) -> str:
    """The model a submission goes to: ``explicit`` (a client's ``model=``, else its settings' ``model``),
    else the only one workers serve."""
    if explicit:
        return explicit
    if len(registered) == 1:
        return next(iter(registered))
    if not registered:
        raise NoModelError("no model given and no worker has registered one (pass model=, or set MLXQ_MODEL)")
    raise NoModelError(f"several models are served ({sorted(registered)}): pass model=")


def decode_registry(raw: dict) -> dict[str, dict]:
    """name -> info; a model whose info cannot be read is still registered (with ``{}``)."""
    out = {}
    for name, blob in raw.items():
        name = name.decode() if isinstance(name, bytes) else name
        try:
            info = codec.unpack(blob)
        except codec.CodecError:
            info = None
        out[name] = info if isinstance(info, dict) else {}
    return out


def known_model(model: str, registry: Optional[dict[str, dict]]) -> Optional[dict]:
    """The registry's info on ``model``; ``NoModelError`` naming the models that exist when workers
    have registered models but never this one.  None, and no check, when the registry could not be
    read (``registry`` None) or is empty (a fresh deployment whose workers are still starting: the job
    waits in the queue, and ``status()`` says "queued, no live worker for MODEL")."""
    if not registry:
        return None
    if model not in registry:
        raise NoModelError(f"model {model!r} is not served by any worker (models: {', '.join(sorted(registry))}); "
                           "pass one of these, or start `mlxq worker --model ...` for it")
    return registry[model]


_unreadable_once = threading.Lock()  # taken by the first report, never released: one log line


def registry_unreadable(exc: Exception) -> None:
    """A producer whose Redis user may not read the model registry submits unchecked (logged once)."""
    if _unreadable_once.acquire(blocking=False):
        log.info("cannot read the model registry (%s): jobs are submitted without checking that the model "
                 "exists or has a live worker", exc)


def has_live_worker(info: Optional[dict], window_s: float, now: Optional[float] = None) -> bool:
    """True when a worker of this model published its stats (the registry's ``seen_at``, written
    every ``stats_interval_s``) within ``window_s`` seconds (``Settings.live_worker_s``)."""
    seen = (info or {}).get("seen_at")
    if not isinstance(seen, (int, float)):
        return False
    return (time.time() if now is None else now) - seen <= window_s


def status_text(status: Optional[str], model: str, info: Optional[dict], window_s: float) -> Optional[str]:
    """A job's status, with "queued, no live worker for MODEL" when nothing can take it now.
    ``info`` None (the registry could not be read): the bare status."""
    if status == "queued" and info is not None and not has_live_worker(info, window_s):
        return f"queued, no live worker for {model}"
    return status
