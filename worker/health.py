"""A worker's health, as its HTTP endpoint reports it (served beside /metrics: worker/metrics.py).

    GET /health   200 while the engine makes progress; 503 once the stuck-step watchdog
                  (worker/watchdog.py) found no step completing for ``stall_s`` while jobs ran
    GET /ready    /health, and 503 too while the worker drains (warm shutdown: it takes no new jobs)

The watchdog is the worker's own (``Worker.watchdog``): the one that stops its heartbeats and exits
it; the endpoint asks it the same question, so an orchestrator and the worker's own exit agree.
"""

from __future__ import annotations

import threading

from .watchdog import Watchdog

STUCK, DRAINING = "stuck", "draining"


class WorkerHealth:
    def __init__(self, watchdog: Watchdog, draining: threading.Event):
        self.watchdog = watchdog
        self.draining = draining

    @classmethod
    def of(cls, worker) -> "WorkerHealth":
        return cls(worker.watchdog, worker.draining)

    def health(self) -> tuple[int, dict]:
        """(HTTP status, JSON body): liveness."""
        if not self.watchdog.check():
            return 503, {"status": STUCK, "reason": self.watchdog.reason}
        return 200, {"status": "ok"}

    def ready(self) -> tuple[int, dict]:
        """(HTTP status, JSON body): liveness, and the worker takes new jobs."""
        code, body = self.health()
        if code == 200 and self.draining.is_set():
            return 503, {"status": DRAINING, "reason": "warm shutdown: the worker finishes its jobs and takes no new ones"}
        return code, body if code != 200 else {"status": "ready"}
