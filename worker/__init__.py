"""The mlxq worker: one process, one model, one thread for every MLX call.

Importing this package loads nothing: the worker's entry points (``mlxq worker``, ``mlxq demo``, the
dev kit, the tests' conftest) call :func:`mlxq.worker.blas.setup` before MLX is imported, which puts
an optimized BLAS under MLX on Linux; the worker logs the result at start-up.
"""

from ..shared.extras import WORKER, require

require(__name__, "worker", WORKER)  # without MLX: one line saying what to install
