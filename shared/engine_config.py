"""The engine's configuration, and the one place its defaults are written.

``Settings`` (settings.py) gives each of these a variable and a flag, takes its default from
here, and builds the config the worker's ``PagedEngine`` runs with
(:meth:`Settings.engine_config`).  What comes from the model (its EOS ids, context length,
tokenizer) is not configuration: the engine takes it beside this.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

BLOCK_SIZE = 32  # tokens per KV block: the only size the engine and its kernels are built and tested for
# prefill chunk size by prompt position: (positions below this, chunk tokens); None: every later position
DEFAULT_CHUNK_SCHEDULE = ((2048, 512), (8192, 256), (20480, 128), (None, 64))
DEFAULT_KV_MEMORY_MB = 512  # the KV pool's budget when neither it nor a block count is set
# speculative decoding: prompt lookup where a verify pass is bit for bit the plain steps (the engine's
# choice, worker/engine/engine.py), none, prompt lookup, a draft model
SPECULATE_MODES = ("auto", "off", "ngram", "draft")


@dataclass(frozen=True)
class EngineConfig:
    max_batch: Optional[int] = None  # a fixed batch size (None: memory-aware admission)
    # the KV pool's budget (None: DEFAULT_KV_MEMORY_MB, never more than max_sequences full contexts)
    memory_budget_bytes: Optional[int] = None
    num_blocks: Optional[int] = None  # a fixed pool size (None: as many blocks as the budget holds)
    block_size: int = BLOCK_SIZE
    pressure: float = 0.85  # admit while used blocks stay under this share of the pool
    prefix_cache: bool = True
    chunked_prefill: bool = True
    chunk_schedule: tuple = DEFAULT_CHUNK_SCHEDULE
    step_token_budget: int = 512  # tokens of one step (prefill chunks + decode rows)
    decode_reserve_blocks: int = 1  # blocks admission keeps free for the running sequences' next tokens
    priority_gap: float = 1.0  # how much more urgent a job must be to preempt another
    max_sequences: int = 256  # running and waiting
    max_waiting: int = 8  # jobs waiting inside the engine for memory
    session_dir: Optional[str] = None  # where hot sessions spill (None: they are dropped)
    attention: str = "auto"  # auto, fused or gather (attention.py)
    matmul: str = "auto"  # auto, pool or mlx (kernels/)
    kv_bits: Optional[int] = None  # quantized KV blocks, 4 or 8 bits (None: the model's float dtype)
    kv_group_size: int = 64
    huge_pages: bool = True  # madvise the weights and the pool to 2 MiB pages (hugepages.py)
    speculate: str = "auto"  # one of SPECULATE_MODES (worker/engine/speculative.py)
    speculate_k: int = 8  # the most tokens one proposal may hold
    draft_model: Optional[str] = None  # the draft model of speculate "draft" (a path or hub id, as the model's)

    def __post_init__(self):
        object.__setattr__(self, "chunk_schedule", tuple(self.chunk_schedule))  # a list reads the same

    def chunk_size(self, pos: int) -> int:
        """The prefill chunk of a prompt at position ``pos``, by ``chunk_schedule``."""
        for limit, size in self.chunk_schedule:
            if limit is None or pos < limit:
                return size
        return self.chunk_schedule[-1][1]
