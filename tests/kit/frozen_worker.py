"""``mlxq worker`` whose engine's n-th step never returns, as a hung kernel's would, so that a test sees the
worker's watchdog notice it (tests/faults/test_takeover.py)::

    python frozen_worker.py N <the arguments of `mlxq`>

The engine is wrapped where the worker command makes it, after the BLAS set-up (which must come before
MLX is imported)."""

from __future__ import annotations

import logging
import sys
import threading

from mlxq.cli import main
from mlxq.worker import blas

log = logging.getLogger("mlxq.test.frozen_worker")


def freeze_at_step(engine, n: int):
    step, count = engine.step, [0]

    def frozen_step():
        count[0] += 1
        if count[0] >= n:
            log.warning("step %d never returns", count[0])
            threading.Event().wait()
        return step()

    engine.step = frozen_step
    return engine


def wrap_make_engine(n: int) -> None:
    """After ``blas.setup()``, as ``mlxq worker`` calls it: each engine made then freezes at step ``n``."""
    setup = blas.setup

    def setup_then_wrap(*a, **kw):
        out = setup(*a, **kw)
        from mlxq.worker.engine import engine

        make = engine.make_engine
        engine.make_engine = lambda *a, **kw: freeze_at_step(make(*a, **kw), n)
        return out

    blas.setup = setup_then_wrap


if __name__ == "__main__":
    wrap_make_engine(int(sys.argv[1]))
    sys.exit(main(sys.argv[2:]))
