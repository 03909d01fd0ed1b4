"""Session files: a session's KV blocks spilled to disk, and loaded back into the pool.

A *hot* session (the scheduler's ``HotSession``) pins the full blocks of its last
turn's computed context, so they stay in the pool.  Spilling writes those blocks
to ``<session_dir>/<sha1(session id)>.safetensors`` (per-layer keys/values plus
the token ids and model id as metadata); the scheduler then drops the pins and
the blocks stay in the prefix cache until reused.  A later turn restores the file
into fresh blocks, which the scheduler registers in the prefix cache before its
prompt is looked up.  The scheduler decides when; this module moves the tensors.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from dataclasses import dataclass
from typing import Optional, Sequence

import mlx.core as mx

from .kv_cache import KVPool

log = logging.getLogger(__name__)


@dataclass
class WarmSession:
    tokens: list[int]
    data: dict  # per part and layer "k{i}" / "v{i}" (+ "ks{i}"... when quantized) arrays (H, n_tokens, W)


class SessionFiles:
    def __init__(self, session_dir: str, model_id: str, pool: KVPool):
        self.session_dir = session_dir
        self.model_id = model_id
        self.pool = pool
        os.makedirs(session_dir, exist_ok=True)

    def path(self, session_id: str) -> str:
        name = hashlib.sha1(session_id.encode()).hexdigest()
        return os.path.join(self.session_dir, name + ".safetensors")

    def spill(self, session_id: str, block_ids: Sequence[int], tokens: list[int]) -> None:
        """Write these blocks of the pool (holding ``tokens``) to the session's file."""
        self.save(session_id, tokens, self.pool.read_blocks(block_ids))

    def restore(self, warm: WarmSession, block_ids: Sequence[int], lo: int, hi: int) -> None:
        """Write tokens ``lo:hi`` of a loaded session into these blocks of the pool."""
        self.pool.write_blocks(block_ids, {k: v[:, lo:hi] for k, v in warm.data.items()})

    def save(self, session_id: str, tokens: list[int], data: dict) -> None:
        """Write the file through a temporary of its own (workers sharing the directory may spill
        the same session at once; each rename is whole). A file that cannot be written (disk
        full, permissions) is logged and skipped: the session stays in the prefix cache until its
        blocks are reused, and a later turn recomputes what was lost."""
        p = self.path(session_id)
        meta = {"tokens": json.dumps(tokens), "model_id": self.model_id, "session_id": session_id,
                "kv_layout": self.pool.layout}
        tmp = None
        try:
            fd, tmp = tempfile.mkstemp(dir=self.session_dir, suffix=".safetensors",
                                       prefix=os.path.basename(p)[: -len(".safetensors")] + ".tmp.")
            os.close(fd)
            mx.save_safetensors(tmp, data, metadata=meta)
            os.replace(tmp, p)
        except OSError as exc:
            log.warning("session %s not spilled to %s: %s", session_id, p, exc)
            if tmp is not None and os.path.exists(tmp):
                os.unlink(tmp)
            return
        log.debug("session %s spilled: %d tokens to %s", session_id, len(tokens), p)

    def load(self, session_id: str) -> Optional[WarmSession]:
        """The session's file if it holds this model's and this pool's blocks; else None (a file
        of another model, layout or shape is logged and left alone: the next spill replaces it)."""
        p = self.path(session_id)
        if not os.path.exists(p):
            return None
        try:
            data, meta = mx.load(p, return_metadata=True)
            if meta.get("model_id") != self.model_id or meta.get("session_id") != session_id:
                return None
            if meta.get("kv_layout", str(self.pool.dtype)) != self.pool.layout:
                log.info("session file %s holds %s KV blocks, this pool %s: not loaded", p,
                         meta.get("kv_layout", self.pool.dtype), self.pool.layout)
                return None
            tokens = json.loads(meta["tokens"])
            why = self._mismatch(tokens, data)
        except Exception:  # a torn or foreign file: ignore it
            log.warning("session file %s unreadable; ignored", p, exc_info=True)
            return None
        if why:
            log.warning("session file %s does not fit this model's pool (%s); ignored", p, why)
            return None
        return WarmSession(tokens, data)

    def _mismatch(self, tokens, data: dict) -> str:
        """Why ``tokens`` and ``data`` are not blocks this pool can take ('' when they are): every
        array of the pool's parts and layers, each (heads, len(tokens), width) in its dtype, over
        whole blocks of token ids."""
        if not isinstance(tokens, list) or not all(type(t) is int and t >= 0 for t in tokens):
            return "its token ids are not a list of ids"
        n = len(tokens)
        if n == 0 or n % self.pool.block_size:
            return f"{n} tokens, not whole blocks of {self.pool.block_size}"
        want = {f"{name}{i}": a for name, arrs in self.pool.store.items() for i, a in enumerate(arrs)}
        if set(data) != set(want):
            return f"arrays {sorted(set(data) ^ set(want))[:4]} differ from the pool's"
        for key, a in want.items():
            x = data[key]
            shape = (a.shape[0], n, a.shape[2])
            if tuple(x.shape) != shape or x.dtype != a.dtype:
                return f"{key} is {tuple(x.shape)} {x.dtype}, the pool takes {shape} {a.dtype}"
        return ""
