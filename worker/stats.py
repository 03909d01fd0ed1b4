"""What a worker counts, and the snapshot of it that control publishes (``mlxq stats``) and observers see.

The MLX loop refreshes the snapshot (``refresh``: it reads MLX's memory counters, so on the MLX
thread); the host counts tokens and ends; the control thread reads ``snapshot`` and publishes it,
at once when ``publish_soon`` is set.
"""

from __future__ import annotations

import logging
import threading
import time

import mlx.core as mx

from ..shared.settings import TIERS
from . import blas

log = logging.getLogger(__name__)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("mlxq")
    except PackageNotFoundError:  # a source tree that was never installed
        return "unknown"


VERSION = _version()  # in every snapshot: the dashboard shows which workers run which release


class Observers:
    """Metrics and rq mirroring: ``on_token(job, n_tokens, now_monotonic)`` and ``on_finish(job, result)``
    on the host thread, ``on_snapshot(snapshot)`` on the MLX thread. They must be cheap and must not
    call MLX. Missing methods are skipped; one that raises is logged."""

    def __init__(self, observers=None):
        self.observers = list(observers or [])

    def notify(self, method: str, *args) -> None:
        for obs in self.observers:
            fn = getattr(obs, method, None)
            if fn is None:
                continue
            try:
                fn(*args)
            except Exception:
                log.exception("observer %r failed in %s", obs, method)


class WorkerStats:
    def __init__(self, worker_id: str, model: str, engine_name: str, interval_s: float, observers: Observers):
        self.worker_id = worker_id
        self.model = model
        self.engine_name = engine_name
        self.interval_s = interval_s
        self.observers = observers
        self.started_at = time.time()
        self.tokens_generated = 0
        self.processed = {"done": 0, "failed": 0, "cancelled": 0, "requeued": 0, "abandoned": 0}
        self.busy_s = 0.0
        self.window: list[tuple[float, int]] = []  # (when, tokens) of each step of the last second
        self.snapshot: dict = {}
        self.snap_at = 0.0
        self.due = False  # a job finished since the last snapshot: refresh and publish it at once
        self.publish_soon = threading.Event()  # read by the control thread

    def step(self, tokens: int, busy_s: float = 0.0) -> None:
        self.window.append((time.monotonic(), tokens))
        self.busy_s += busy_s

    def count(self, status: str) -> None:
        """A job ended with ``status`` (or went back to the queue: "requeued", "abandoned")."""
        self.processed[status] += 1

    def finished(self, status: str) -> None:
        """Host thread: a job's result went out; the next snapshot is taken and published at once."""
        self.count(status)
        self.due = True

    def due_now(self) -> bool:
        """Every half second at most; at once when a job just finished, so that `mlxq stats` right
        after a result counts its tokens."""
        return self.due or time.monotonic() - self.snap_at >= min(0.5, self.interval_s)

    def refresh(self, jobs: dict, ready: int, round_trips: int, draining: bool, engine_stats: dict) -> None:
        """MLX thread (it reads MLX's memory counters): take the snapshot, and have it published at once
        when a job just finished. ``jobs``: the worker's active jobs, which the host thread ends meanwhile.
        The counts are read before the jobs: a job leaves ``jobs`` before it is counted, so a snapshot
        that counts a job never also has it active."""
        processed = dict(self.processed)
        active = list(jobs.values())
        now = time.monotonic()
        self.snap_at = now
        self.window = [(t, n) for t, n in self.window if now - t <= 1.0]
        current = sum(n for _, n in self.window) / 1.0
        self.snapshot = {
            "worker_id": self.worker_id,
            "model": self.model,
            "engine": self.engine_name,
            "version": VERSION,
            "started_at": self.started_at,
            "updated_at": time.time(),
            "active": len(active),
            "active_by_tier": {t: sum(1 for j in active if j.tier == t) for t in TIERS},
            "ready": ready,
            "processed": processed,
            "tokens_generated": self.tokens_generated,
            "tok_s_current": current,
            "tok_s_avg": self.tokens_generated / self.busy_s if self.busy_s else 0.0,
            "peak_memory_bytes": mx.get_peak_memory(),
            "active_memory_bytes": mx.get_active_memory(),
            "publish_round_trips": round_trips,
            "blas": blas.describe(),
            "draining": draining,
            **{f"engine_{k}" if not k.startswith("engine") else k: v for k, v in engine_stats.items()},
        }
        self.observers.notify("on_snapshot", self.snapshot)
        if self.due:
            self.due = False
            self.publish_soon.set()
