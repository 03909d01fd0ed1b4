"""mlxq: Redis-queue-driven LLM inference workers on MLX.

One import name. The repository keeps the design's folders at its top level (``producer/``,
``worker/``, ``shared/``); ``pyproject.toml`` maps them to ``mlxq.producer``, ``mlxq.worker``
and ``mlxq.shared`` when installed. In a source checkout they sit beside this folder rather than
inside it, so the package's search path also covers the checkout's root.

    from mlxq import Client, AsyncClient

Importing ``mlxq`` does not import MLX: producers need only Redis. The worker's entry points call
``mlxq.worker.blas.setup()``, which puts an optimized BLAS under MLX before MLX loads.
"""

import os as _os

_here = _os.path.dirname(_os.path.abspath(__file__))
if not _os.path.isdir(_os.path.join(_here, "producer")):  # a source checkout, not an install
    __path__.append(_os.path.dirname(_here))  # noqa: F821  (a package's own __path__)

from .producer import (  # noqa: E402
    AsyncClient,
    AsyncJob,
    AuthError,
    Client,
    Job,
    JobRefused,
    JobTimeout,
    NoModelError,
    OverloadError,
)

__all__ = ["Client", "AsyncClient", "Job", "AsyncJob", "OverloadError", "AuthError", "JobRefused",
           "JobTimeout", "NoModelError", "generate"]


def __getattr__(name):
    # ``mlxq.generate`` is the rq function path (rq imports ``mlxq`` and looks the name up); it is
    # resolved lazily so that producers importing ``mlxq`` never load the worker or MLX.
    if name == "generate":
        from .producer.rq_bridge import generate
        return generate
    raise AttributeError(f"module 'mlxq' has no attribute {name!r}")
