"""Processes of the gateway's tests: a worker and ``lorapool serve``, started as a user
would start them, on a free port of 127.0.0.1."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path


def lorapool_cmd(*args: str) -> list[str]:
    return [sys.executable, "-c", "from lorapool.cli.main import main; main()", *args]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(check, what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"{what} did not happen in {timeout}s"
        time.sleep(0.1)


def start_worker(redis_url: str, prefix: str, model: str, cwd, *extra: str) -> subprocess.Popen:
    cmd = lorapool_cmd(
        "worker", "--model", model, "--prefix", prefix, "--redis-url", redis_url,
        "--max-num-seqs", "8", "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
        "--lease", "2",  # abort flags are read with each renewal (a third of the lease)
        *extra,
    )  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # cwd outside the checkout: the repo root on sys.path would shadow packages
    return subprocess.Popen(cmd, cwd=cwd, env=env, stderr=subprocess.DEVNULL)


def start_pool_worker(
    conn, redis_url: str, prefix: str, model: str, cwd, *extra: str, workers: int = 1
) -> subprocess.Popen:
    """``start_worker``, once the pool has ``workers`` workers registered, this one alive."""
    proc = start_worker(redis_url, prefix, model, cwd, *extra)
    workers_key = f"{prefix}:workers"
    wait_until(lambda: conn.hlen(workers_key) >= workers or proc.poll() is not None, "start")
    assert proc.poll() is None, "the worker exited"
    return proc


def start_gateway(
    redis_url: str, prefix: str, port: int, cwd, *extra: str, auth: bool = False
) -> subprocess.Popen:
    cmd = lorapool_cmd(
        "serve", "--port", str(port), "--prefix", prefix, "--redis-url", redis_url,
        "--log-level", "warning", *extra, *(() if auth else ("--no-auth",)),
    )  # fmt: skip
    return subprocess.Popen(cmd, cwd=cwd)


def wait_answering(proc: subprocess.Popen, url: str, what: str, timeout: float = 60) -> None:
    """Until ``url`` answers 200; fails at once if ``proc`` (``what``) exits."""
    import httpx

    def answering() -> bool:
        assert proc.poll() is None, f"{what} exited"
        try:
            return httpx.get(url, timeout=5).status_code == 200
        except httpx.TransportError:
            return False

    wait_until(answering, f"{what} answering {url}", timeout)


def serve(
    redis_url: str, prefix: str, cwd, *extra: str, auth: bool = False, path: str = "/healthz"
) -> tuple[str, subprocess.Popen]:
    """``lorapool serve`` on a free port once ``path`` answers 200: (its URL, the process)."""
    port = free_port()
    proc = start_gateway(redis_url, prefix, port, cwd, *extra, auth=auth)
    url = f"http://127.0.0.1:{port}"
    wait_answering(proc, f"{url}{path}", "the gateway")
    return url, proc


def serve_logged(
    redis_url: str, prefix: str, cwd, *extra: str, env: dict | None = None
) -> tuple[str, subprocess.Popen, Path]:
    """``lorapool serve`` with keys on a free port, its output in ``cwd/gateway.log``, once
    it answers: (its URL, the process, the log); ``env``: variables added to this one's."""
    port = free_port()
    cmd = lorapool_cmd(
        "serve", "--port", str(port), "--prefix", prefix, "--redis-url", redis_url, *extra
    )
    log = Path(cwd) / "gateway.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd, cwd=cwd, env={**os.environ, **(env or {})}, stdout=out, stderr=subprocess.STDOUT
        )
    url = f"http://127.0.0.1:{port}"
    wait_answering(proc, f"{url}/healthz", "the gateway")
    return url, proc, log


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def start_audit_writer(redis_url: str, prefix: str, db_url: str, cwd, *extra: str):
    """``lorapool audit-writer --migrate`` of the pool (the test's audit key)."""
    cmd = lorapool_cmd(
        "audit-writer", "--redis-url", redis_url, "--prefix", prefix, "--db-url", db_url,
        "--migrate", "--log-level", "WARNING", *extra,
    )  # fmt: skip
    return subprocess.Popen(cmd, cwd=cwd)
