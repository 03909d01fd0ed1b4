"""Notices a worker whose engine stopped making progress.

Leases are renewed by the control thread whatever the MLX thread does, so a step that never returns
(a hung kernel, a deadlock, a host thread that stopped taking steps' tokens) would keep its jobs
leased for ever. The MLX thread marks each step it starts and finishes; the control thread asks
``check()`` before each heartbeat. Once no step has completed for ``stall_s`` while jobs were
running, the watchdog is unhealthy for good: the worker renews nothing more and exits, and other
workers take its jobs over. ``healthy`` and ``reason`` are what a health endpoint reports.
"""

from __future__ import annotations

import time
from typing import Callable, Optional


class Watchdog:
    def __init__(self, stall_s: float, clock: Callable[[], float] = time.monotonic):
        self.stall_s = stall_s
        self._clock = clock
        self._since = clock()  # the last step's completion, or the first step's start after idling
        self._busy = False
        self.reason: Optional[str] = None

    @property
    def healthy(self) -> bool:
        return self.reason is None

    # -- the MLX thread ------------------------------------------------------
    def step_started(self) -> None:
        if not self._busy:  # idle until now: the stall is timed from this step's start
            self._since = self._clock()
            self._busy = True

    def step_done(self) -> None:
        self._since = self._clock()

    def idle(self) -> None:
        """No job in the engine: waiting is not a stall."""
        self._busy = False

    # -- any thread ----------------------------------------------------------
    def check(self) -> bool:
        """True while healthy; the first call past ``stall_s`` without a step sets ``reason``."""
        if self.reason is None and self._busy:
            quiet = self._clock() - self._since
            if quiet > self.stall_s:
                self.reason = (f"no engine step completed in {quiet:.1f}s while jobs were running "
                               f"(MLXQ_STALL_S {self.stall_s:g})")
        return self.reason is None
