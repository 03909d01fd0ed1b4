"""Progress for the slow first-run steps (building the small model, compiling the CPU extension).

Each step logs a line when it starts (what, and roughly how long) and one when it ends (how long it
took); on a terminal a tqdm bar shows it moving in between.  Off a terminal (tests, CI, a log file)
there is no bar, only the two lines, so nothing floods captured output.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from typing import Iterator, Optional

from tqdm import tqdm


@contextlib.contextmanager
def step(log: logging.Logger, what: str, *, total: Optional[float] = None, unit: str = "it",
         expect: str = "") -> Iterator[tqdm]:
    """``with step(log, "training the tiny model", total=500, unit="step") as bar: ... bar.update()``."""
    log.info("%s%s ...", what, f" ({expect})" if expect else "")
    t0 = time.perf_counter()
    bar = tqdm(total=total, desc=what, unit=unit, file=sys.stderr, leave=False, dynamic_ncols=True,
               disable=not _on_terminal())
    ok = False
    try:
        yield bar
        ok = True
    finally:
        bar.close()
        log.log(logging.INFO if ok else logging.WARNING, "%s: %s after %.1f s", what, "done" if ok else "failed",
                time.perf_counter() - t0)


def _on_terminal() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False
