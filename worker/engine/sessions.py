"""Session cache: keep a finished turn's KV blocks hot, spill them to disk warm.

A *hot* session pins (holds one reference on) the full blocks of its last turn's
computed context, so they stay in the pool.  Spilling writes those blocks to
``<session_dir>/<sha1(session id)>.safetensors`` (per-layer keys/values plus the
token ids and model id as metadata) and drops the pins; the blocks stay in the
prefix cache until reused.  A later turn restores the file into fresh blocks,
registered in the prefix cache, before its prompt is looked up.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional

import mlx.core as mx

log = logging.getLogger(__name__)


@dataclass
class HotSession:
    session_id: str
    block_ids: list[int]
    tokens: list[int]  # the tokens of those full blocks


@dataclass
class WarmSession:
    tokens: list[int]
    data: dict  # per-layer "k{i}" / "v{i}" arrays (H, n_tokens, D)


class SessionStore:
    def __init__(self, session_dir: Optional[str], model_id: str):
        self.session_dir = session_dir
        self.model_id = model_id
        self.hot: "OrderedDict[str, HotSession]" = OrderedDict()
        if session_dir:
            os.makedirs(session_dir, exist_ok=True)

    def path(self, session_id: str) -> Optional[str]:
        if not self.session_dir:
            return None
        name = hashlib.sha1(session_id.encode()).hexdigest()
        return os.path.join(self.session_dir, name + ".safetensors")

    def put_hot(self, s: HotSession) -> Optional[HotSession]:
        """Make ``s`` hot (most recent); returns the replaced entry, if any."""
        old = self.hot.pop(s.session_id, None)
        self.hot[s.session_id] = s
        return old

    def touch(self, session_id: str) -> None:
        if session_id in self.hot:
            self.hot.move_to_end(session_id)

    def oldest_hot(self) -> Optional[HotSession]:
        return next(iter(self.hot.values()), None)

    def save(self, s: HotSession, data: dict) -> bool:
        p = self.path(s.session_id)
        if p is None:
            return False
        meta = {"tokens": json.dumps(s.tokens), "model_id": self.model_id,
                "session_id": s.session_id}
        tmp = p[: -len(".safetensors")] + ".tmp.safetensors"
        mx.save_safetensors(tmp, data, metadata=meta)
        os.replace(tmp, p)
        log.debug("session %s spilled: %d tokens to %s", s.session_id, len(s.tokens), p)
        return True

    def load(self, session_id: str) -> Optional[WarmSession]:
        p = self.path(session_id)
        if p is None or not os.path.exists(p):
            return None
        try:
            data, meta = mx.load(p, return_metadata=True)
        except Exception:  # a torn or foreign file: ignore it
            log.warning("session file %s unreadable; ignored", p, exc_info=True)
            return None
        if meta.get("model_id") != self.model_id or meta.get("session_id") != session_id:
            return None
        return WarmSession(json.loads(meta["tokens"]), data)

    def warm_count(self) -> int:
        if not self.session_dir:
            return 0
        return sum(1 for f in os.listdir(self.session_dir)
                   if f.endswith(".safetensors") and ".tmp." not in f)
