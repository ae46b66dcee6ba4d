"""What one held job-events stream costs the gateway (issue 51 row 5): its resident
memory and file descriptors per stream, so that ``--max-streams`` bounds them.

A ``lorapool serve`` with keys and no caps (``--max-streams 0``, per tenant 0, per
address 0), one queued job (no worker: its events stream waits), then ``--streams``
raw connections each reading ``GET /v1/jobs/{id}/events`` to its first bytes and held.
Reported: the gateway's VmRSS and open fds after ``--warm`` streams and after all of
them, and the difference per stream.

    lorapool bench held_streams [--streams 1000] [--warm 50]

Redis: ``--redis-url``, else ``$REDIS_URL``, else 127.0.0.1:6379/0 (its keys live
under a fresh prefix, deleted after).
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
import uuid

import httpx
import redis

from lorapool.lifecycle.keys import Keys
from lorapool.producer import Producer
from lorapool.producer.api_keys import ApiKeys
from lorapool.protocol import SamplingParams


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _hold(port: int, path: str, key: str) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n\r\n".encode())
    seen = b""
    while b"retry:" not in seen:
        part = sock.recv(4096)
        if not part:
            raise RuntimeError(f"the stream closed: {seen[:200]!r}")
        seen += part
    return sock


def _settled(pid: int) -> int:
    time.sleep(2.0)
    return _rss_kib(pid)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--redis-url", default=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
    )
    parser.add_argument("--streams", type=int, default=1000)
    parser.add_argument("--warm", type=int, default=50)
    args = parser.parse_args()
    conn = redis.Redis.from_url(args.redis_url)
    prefix = f"bench-held-{uuid.uuid4().hex[:8]}"
    _, key = ApiKeys(conn, Keys(prefix)).add("acme", "submit")
    Producer(conn, prefix=prefix).submit(
        "waits", SamplingParams(max_tokens=1), request_id="acme~held"
    )
    port = _free_port()
    cmd = [sys.executable, "-c", "from lorapool.cli.main import main; main()", "serve"]
    cmd += ["--port", str(port), "--prefix", prefix, "--redis-url", args.redis_url]
    cmd += [
        "--max-connections-per-client",
        "0",
        "--max-streams",
        "0",
        "--max-streams-per-tenant",
        "0",
    ]
    cmd += ["--max-connections", "0", "--log-level", "warning"]
    proc = subprocess.Popen(cmd, cwd=tempfile.mkdtemp())
    held: list[socket.socket] = []
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(300):
            try:
                if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        path = "/v1/jobs/held/events"
        idle = _settled(proc.pid)
        held += [_hold(port, path, key) for _ in range(args.warm)]
        warm, warm_fds = _settled(proc.pid), _fds(proc.pid)
        held += [_hold(port, path, key) for _ in range(args.streams - args.warm)]
        full, full_fds = _settled(proc.pid), _fds(proc.pid)
        extra = args.streams - args.warm
        print(f"gateway RSS idle {idle / 1024:.1f} MiB; {args.warm} streams {warm / 1024:.1f} MiB; "
              f"{args.streams} streams {full / 1024:.1f} MiB")  # fmt: skip
        print(f"per held stream: {(full - warm) * 1024 / extra / 1024:.1f} KiB, "
              f"{(full_fds - warm_fds) / extra:.2f} fds")  # fmt: skip
    finally:
        for sock in held:
            sock.close()
        proc.terminate()
        proc.wait(timeout=30)
        for name in conn.scan_iter(f"{prefix}:*"):
            conn.delete(name)


if __name__ == "__main__":
    main()
