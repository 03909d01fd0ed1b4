"""``mlxq worker`` with its engine wrapped where the worker command makes it, after the BLAS set-up
(which must come before MLX is imported)::

    python frozen_worker.py N <the arguments of `mlxq`>

the engine's n-th step never returns, as a hung kernel's would, so that a test sees the worker's
watchdog notice it (tests/faults/test_takeover.py);

    python frozen_worker.py speculate <the arguments of `mlxq`>

every step where a row has a proposal speculates (the step-time policy out of the way, so a test of
speculation does not depend on how fast steps run: tests/faults/test_resume.py)."""

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


def speculate_always(engine):
    if engine.speculator is None:
        raise SystemExit("speculate: this worker's engine does not speculate (--speculate off, or auto off here)")
    engine.speculator.costs.always = True
    return engine


def wrap_make_engine(wrap) -> None:
    """After ``blas.setup()``, as ``mlxq worker`` calls it: each engine made then is ``wrap(engine)``."""
    setup = blas.setup

    def setup_then_wrap(*a, **kw):
        out = setup(*a, **kw)
        from mlxq.worker.engine import engine

        make = engine.make_engine
        engine.make_engine = lambda *a, **kw: wrap(make(*a, **kw))
        return out

    blas.setup = setup_then_wrap


if __name__ == "__main__":
    mode = sys.argv[1]
    wrap_make_engine(speculate_always if mode == "speculate" else lambda e, n=int(mode): freeze_at_step(e, n))
    sys.exit(main(sys.argv[2:]))
