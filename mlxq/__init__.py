"""mlxq: Redis-queue-driven LLM inference workers on MLX.

One import name. The repository keeps the design's folders at its top level (``producer/``,
``worker/``, ``shared/``); ``pyproject.toml`` maps them to ``mlxq.producer``, ``mlxq.worker``
and ``mlxq.shared`` when installed (an editable install maps them too). So a checkout's root must
not come first on ``sys.path``: its ``mlxq/`` lacks them (run the tests with ``.venv/bin/pytest``,
not ``python -m pytest``).

    from mlxq import Client, AsyncClient

Importing ``mlxq`` does not import MLX: producers need only Redis, and ``pip install mlxq`` installs
only what they use; ``mlxq[worker]`` adds MLX and the engine, ``mlxq[gateway]`` the HTTP server
(without them, ``mlxq.worker`` and ``mlxq.producer.gateway`` say in one line what to install). The
worker's entry points call ``mlxq.worker.blas.setup()``, which puts an optimized BLAS under MLX before
MLX loads.
"""

try:
    from .producer import (
        AsyncClient,
        AsyncJob,
        AuthError,
        Client,
        ClientClosed,
        EmbeddingFailed,
        Job,
        JobNotFound,
        JobRefused,
        JobTimeout,
        NoModelError,
        OverloadError,
        QuotaExceeded,
    )
except ModuleNotFoundError as _exc:
    if _exc.name != f"{__name__}.producer":
        raise
    raise ImportError(
        f"mlxq was imported from a source checkout's {__path__[0]!r}, which lacks producer/, worker/ and "  # noqa: F821
        "shared/ (they are mapped in when installed): the checkout's root is first on sys.path. Install mlxq "
        "(pip install -e .) and run from another folder; for the tests, .venv/bin/pytest (not python -m pytest)"
    ) from None

__all__ = ["Client", "AsyncClient", "Job", "AsyncJob", "OverloadError", "AuthError", "JobRefused",
           "JobTimeout", "JobNotFound", "ClientClosed", "NoModelError", "EmbeddingFailed", "QuotaExceeded",
           "generate"]


def __getattr__(name):
    # ``mlxq.generate`` is the rq function path (rq imports ``mlxq`` and looks the name up); it is
    # resolved lazily so that producers importing ``mlxq`` never load the worker or MLX.
    if name == "generate":
        from .producer.rq_bridge import generate
        return generate
    raise AttributeError(f"module 'mlxq' has no attribute {name!r}")
