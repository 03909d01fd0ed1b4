"""The host side of a step, off the MLX thread.

The MLX thread's critical path is: schedule a step, build its graph, launch it.  What the
worker does with a step's tokens (detokenize, stop strings, deltas, results, stats, handing
them to the publisher) needs no MLX, so it runs here, in step order, while the MLX thread is
already inside the next launch (``mx.async_eval`` releases the GIL while MLX computes).

``HostWork`` runs the callables put on it one at a time, in order, on one thread.  At most
``depth`` steps wait: the MLX thread blocks rather than run ahead of its output (the
engine's next steps would otherwise pile up tokens nobody has published).  An exception in a
callable is kept and raised on the MLX thread by the next ``check()``: the worker stops as it
did when that work ran inline.  ``inline=True`` runs each callable at once on the caller's
thread (for A/B measurement: ``MLXQ_HOST_THREAD=0``).
"""

from __future__ import annotations

import queue
import threading
from typing import Callable, Optional


class HostWork:
    def __init__(self, *, inline: bool = False, depth: int = 2):
        self.inline = inline
        self._q: "queue.Queue[Optional[Callable[[], None]]]" = queue.Queue(maxsize=depth)
        self._error: Optional[BaseException] = None
        self._thread: Optional[threading.Thread] = None  # started by the first put

    def put(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the host thread after everything put before it (blocks while ``depth`` steps wait)."""
        if self.inline:
            fn()
            return
        self.check()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="mlxq-host", daemon=True)
            self._thread.start()
        self._q.put(fn)

    def drain(self) -> None:
        """Wait until everything put has run (then raise its first error, if any)."""
        if not self.inline:
            self._q.join()
        self.check()

    def check(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def close(self) -> None:
        if self._thread is not None:
            self._q.put(None)
            self._thread.join(timeout=5)
            self._thread = None

    def _run(self) -> None:
        while True:
            fn = self._q.get()
            try:
                if fn is None:
                    return
                if self._error is None:  # after an error, nothing more runs (the worker is stopping)
                    fn()
            except BaseException as exc:  # noqa: BLE001 - handed to the MLX thread
                self._error = exc
            finally:
                self._q.task_done()
