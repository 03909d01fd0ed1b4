"""The MLX thread's inbox: jobs the other rooms want ended, read once a pass by the MLX loop.

Control puts cancels (its cancel listener, its heartbeat's reply) and lost leases (its heartbeat);
the publisher puts the leases of jobs whose writes Redis would not take; the MLX loop puts its own
timeouts, so that every end goes through one place, in order.  A lost lease names its owner token:
the worker may have pulled the job again since, and that newer lease is not the one lost.
"""

from __future__ import annotations

import queue
from typing import Iterator


class Inbox:
    def __init__(self):
        # ("cancel" | "timeout", job ids) or ("lost", (job id, owner token) pairs)
        self._q: "queue.Queue[tuple[str, list]]" = queue.Queue()

    def cancel(self, job_ids) -> None:
        self._q.put(("cancel", list(job_ids)))

    def timeout(self, job_ids) -> None:
        self._q.put(("timeout", list(job_ids)))

    def lost(self, leases) -> None:
        self._q.put(("lost", list(leases)))

    def take(self) -> Iterator[tuple[str, list]]:
        """What is in the inbox now, oldest first (never blocks)."""
        while True:
            try:
                yield self._q.get_nowait()
            except queue.Empty:
                return
