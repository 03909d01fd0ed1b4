"""A Valkey Cluster on loopback for the tests (cluster and failover tests): real Valkey nodes from
the wheel (``mlxq.shared.embedded.EmbeddedRedis``) formed into a cluster."""

from __future__ import annotations

from mlxq.shared.embedded import EmbeddedRedis


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

    def make_master_again(self, node: EmbeddedRedis, key: str, timeout: float = 60.0) -> None:
        """``node``, killed and started again, rejoined as a replica of its slot's new master: a
        manual failover makes it the master of ``key``'s slot again, so that a test can kill it again."""
        import time

        c = self.client(node)

        def replication(field: str):
            try:
                return c.info("replication").get(field)
            except Exception:  # still loading
                return None

        deadline = time.monotonic() + timeout
        self._wait(lambda: replication("master_link_status") == "up", deadline, "the link to its master")
        c.execute_command("CLUSTER", "FAILOVER")
        self._wait(lambda: replication("role") == "master", deadline, "the manual failover")
        self.wait_ok(timeout)
        assert self.master_for(key) is node

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
