"""A private 3-master Redis Cluster for tests that stop, kill, measure or configure it.

Each node is a ``RedisServer`` in cluster mode (its own port, cluster bus port and
directory under the test's temporary one), joined by ``redis-cli --cluster create
... --cluster-replicas 0`` as ``.ci/redis-cluster`` does. Unlike that one, a node
keeps what a restart needs: its AOF (``appendfsync always``, every acknowledged
write) and its ``nodes.conf`` (its id, its slots, the other nodes), so a node killed
and started again on the same port and directory rejoins the cluster with its
slots and their data, as a restarted standalone server comes back with its data.

Its faults are a node's: ``node_of(key)`` is the node that serves ``key``'s slot,
and that node's ``pause``/``resume``/``kill``/``start`` stall or restart it alone
(the other nodes go on). ``NODE_TIMEOUT_MS`` is above the tests' longest stall (15
s): a stall shorter than the node timeout is a stall to the cluster too, not a
failure (past it, with no replica to promote, the cluster would mark the node
failed, and every node would refuse commands until twice the node timeout after).
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import redis
from redis.crc import key_slot
from redis_server import RedisServer, free_port

from lorapool.embedded import cli_executable

NODE_TIMEOUT_MS = 30_000


class RedisCluster:
    shards = 3  # the pool's layout on it: a shard per master

    def __init__(self, directory: Path, masters: int = 3):
        self.cli = shutil.which("redis-cli") or cli_executable()
        if self.cli is None:
            raise RuntimeError("no redis-cli on PATH and no embedded valkey-cli")
        directory = Path(directory)
        self.nodes = []
        for i in range(masters):
            node_dir = directory / f"node{i}"
            args = ("--cluster-enabled", "yes", "--cluster-port", str(free_port()))
            args += ("--cluster-config-file", str(node_dir / "nodes.conf"))
            args += ("--cluster-node-timeout", str(NODE_TIMEOUT_MS))
            self.nodes.append(RedisServer(node_dir, args=args))

    @property
    def url(self) -> str:
        """A node's address as ``lorapool.connection.connect`` takes a cluster's."""
        return f"redis+cluster://127.0.0.1:{self.nodes[0].port}/0"

    def start(self, timeout: float = 30.0) -> RedisCluster:
        for node in self.nodes:
            node.start()
        cmd = [self.cli, "--cluster", "create", *(f"127.0.0.1:{n.port}" for n in self.nodes)]
        cmd += ["--cluster-replicas", "0", "--cluster-yes"]
        subprocess.run(cmd, check=True, capture_output=True, timeout=timeout)
        self.wait_ok(timeout)
        return self

    def wait_ok(self, timeout: float = 30.0) -> None:
        """Until every node says ``cluster_state:ok`` and knows every other one."""
        deadline = time.monotonic() + timeout
        while not all(self._ok(node) for node in self.nodes):
            if time.monotonic() > deadline:
                raise RuntimeError("the private Redis Cluster did not come up")
            time.sleep(0.1)

    def _ok(self, node: RedisServer) -> bool:
        client = node.client(socket_timeout=1)
        try:
            info = client.cluster("info")
        finally:
            client.close()
        known = int(info["cluster_known_nodes"])
        return info["cluster_state"] == "ok" and known == len(self.nodes)

    def node_of(self, key: str) -> RedisServer:
        """The node that serves ``key``'s slot (asked of a node that is up)."""
        slot = key_slot(key.encode())
        for node in self.nodes:
            client = node.client(socket_timeout=1)
            try:
                ranges = client.execute_command("CLUSTER", "SLOTS")
            except redis.RedisError:
                continue
            finally:
                client.close()
            for first, last, master, *_ in ranges:
                if first <= slot <= last:
                    return next(n for n in self.nodes if n.port == int(master[1]))
        raise RuntimeError(f"no node of the private Redis Cluster serves slot {slot}")

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


@contextmanager
def private_redis(layout: str, directory: Path) -> Iterator[RedisServer | RedisCluster]:
    """A private Redis of the pool layout (``standalone``: a ``RedisServer``;
    ``cluster``: a 3-master ``RedisCluster``) in ``directory``, stopped after."""
    server = RedisCluster(directory) if layout == "cluster" else RedisServer(directory)
    try:
        yield server.start()
    finally:
        server.stop()
