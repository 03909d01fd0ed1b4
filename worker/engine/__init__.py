"""Paged KV cache engine: block pool, prefix cache, preemption, sessions."""

from .block_manager import BLOCK_SIZE, BlockManager
from .engine import PagedEngine

__all__ = ["BLOCK_SIZE", "BlockManager", "PagedEngine"]
