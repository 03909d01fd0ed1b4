"""The mlxq worker: one process, one model, one thread for every MLX call.

Importing this package first puts an optimized BLAS under MLX on Linux (see
:mod:`mlxq.worker.blas`); the result is logged by the worker at start-up.
"""

from . import blas as _blas

BLAS_STATUS = _blas.setup()
