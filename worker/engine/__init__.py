"""The paged-KV engine, laid out like nano-vllm's.

``engine.PagedEngine`` (its ``step()``: schedule, run, postprocess) and its ``api`` (the
contract with the worker loop); ``scheduler`` (who runs: plain Python) with ``intake`` (a spec
becomes a sequence), ``forks`` (n samples share a prefill) and ``hot_sessions`` (a finished
turn's blocks kept for the next); ``sequence``, ``block_manager`` (pure bookkeeping),
``model_runner`` (plans to arrays, forward passes, every ``mx.eval``), ``sampler``,
``kv_cache`` (the block pool behind mlx-lm's cache protocol), ``sessions`` (spill
files), ``attention`` and ``kernels/`` (the CPU extension: C++ sources and their build).

Importing this package does not import MLX: the scheduler side stays usable (and
testable) without it; ``PagedEngine`` is loaded on first access.
"""

from .block_manager import BLOCK_SIZE, BlockManager

__all__ = ["BLOCK_SIZE", "BlockManager", "PagedEngine"]


def __getattr__(name):
    if name == "PagedEngine":
        from .engine import PagedEngine

        return PagedEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
