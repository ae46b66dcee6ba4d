"""A private redis-server for tests that stop, kill or measure it.

Runs on a free port in a temporary directory, with AOF (``appendfsync
always``) so that a restart after SIGKILL keeps every acknowledged write.
``pause``/``resume`` send SIGSTOP/SIGCONT (a stalled server), ``kill`` sends
SIGKILL and ``start`` brings it back on the same port and directory. ``args``:
more options of redis-server (a node of ``redis_cluster.RedisCluster``). A pool's
private Redis, standalone or cluster, offers ``url``, ``shards``, ``nodes`` and
``node_of(key)`` (here: this server), so that a test faults either the same way.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import redis

from lorapool.embedded import server_executable


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class PortTaken(RuntimeError):
    """The server exited at start: its port or cluster bus port was in use."""


def _fresh_bus_port(args: tuple[str, ...]) -> tuple[str, ...]:
    """``args`` with a fresh ``--cluster-port`` value, if it has one."""
    args = list(args)
    if "--cluster-port" in args:
        args[args.index("--cluster-port") + 1] = str(free_port())
    return tuple(args)


class RedisServer:
    shards = 0  # the pool's layout on it: one standalone Redis

    def __init__(self, directory: Path, port: int | None = None, args: tuple[str, ...] = ()):
        # redis-server on PATH, else the embedded Valkey's (a fresh machine's)
        self.binary = shutil.which("redis-server") or server_executable()
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.args = tuple(args)
        self.process: subprocess.Popen | None = None
        self._pick_again = port is None  # until a first start: its ports were only free then

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def nodes(self) -> list[RedisServer]:
        return [self]

    def node_of(self, key: str) -> RedisServer:
        """The server that holds ``key``: this one."""
        return self

    def client(self, **options) -> redis.Redis:
        """A plain client of this server (no retries: an admin's or a probe's)."""
        return redis.Redis(port=self.port, **options)

    def start(self, timeout: float = 10.0) -> RedisServer:
        """Start it (again: on the same port and directory). A first start whose port, or
        cluster bus port, another socket took since ``free_port`` saw it free (an outgoing
        connection's ephemeral port, say) tries again on fresh ones."""
        for attempt in range(5):
            try:
                self._start(timeout)
            except PortTaken:
                if not self._pick_again or attempt == 4:
                    raise
                (self.directory / "redis.log").unlink(missing_ok=True)  # this attempt's
                self.port, self.args = free_port(), _fresh_bus_port(self.args)
                continue
            self._pick_again = False
            return self
        raise AssertionError("unreachable")

    def _start(self, timeout: float) -> None:
        cmd = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1"]
        cmd += ["--dir", str(self.directory), "--save", "", "--appendonly", "yes"]
        cmd += ["--appendfsync", "always", "--logfile", "redis.log", *self.args]
        self.process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, socket_timeout=1)
        deadline = time.monotonic() + timeout
        while True:
            try:
                if client.ping():
                    break
            except (redis.ConnectionError, redis.BusyLoadingError):
                if self.process.poll() is not None and self._port_taken():
                    client.close()
                    raise PortTaken(f"redis-server on {self.port}: a port in use") from None
                if time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server on {self.port} did not start") from None
                time.sleep(0.05)
        client.close()

    def _port_taken(self) -> bool:
        log = self.directory / "redis.log"
        return log.exists() and "Address already in use" in log.read_text(errors="replace")

    def pause(self) -> None:
        os.kill(self.process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.process.pid, signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL: no shutdown, no final save (the AOF holds what was acknowledged)."""
        self.process.kill()
        self.process.wait(10)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.resume()
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
