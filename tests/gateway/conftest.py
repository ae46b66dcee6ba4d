"""A pool for the gateway's tests: real Redis, a worker process on the tiny model with
two adapters, and ``lorapool serve`` under uvicorn on a free port of 127.0.0.1.

One pool per test module (starting a worker takes seconds on a shared CPU); each
module's keys live under their own prefix and are deleted after it.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid

import httpx
import pytest
import redis

from lorapool.producer import Producer

ADAPTERS = {"ad-qv": ("q_proj", "v_proj"), "ad-mlp": ("gate_proj", "up_proj")}


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


def start_worker(redis_url: str, prefix: str, model: str, cwd) -> subprocess.Popen:
    cmd = lorapool_cmd(
        "worker", "--model", model, "--prefix", prefix, "--redis-url", redis_url,
        "--max-num-seqs", "8", "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
        "--lease", "2",  # abort flags are read with each renewal (a third of the lease)
    )  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # cwd outside the checkout: the repo root on sys.path would shadow packages
    return subprocess.Popen(cmd, cwd=cwd, env=env, stderr=subprocess.DEVNULL)


def start_gateway(redis_url: str, prefix: str, port: int, cwd, *extra: str) -> subprocess.Popen:
    cmd = lorapool_cmd(
        "serve", "--port", str(port), "--prefix", prefix, "--redis-url", redis_url,
        "--log-level", "warning", *extra,
    )  # fmt: skip
    return subprocess.Popen(cmd, cwd=cwd)


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def model(tiny_model_path):
    return str(tiny_model_path("llama"))


@pytest.fixture(scope="module")
def adapter_dirs(model, tmp_path_factory):
    from adapters import build_adapter

    root = tmp_path_factory.mktemp("gateway-adapters")
    return {
        name: build_adapter(model, root / name, rank=8, targets=t, seed=i, std=0.2)
        for i, (name, t) in enumerate(ADAPTERS.items())
    }


@pytest.fixture(scope="module")
def conn(redis_url):
    connection = redis.Redis.from_url(redis_url)
    yield connection
    connection.close()


@pytest.fixture(scope="module")
def prefix(conn):
    """A fresh key prefix for the module; every key under it is deleted after it."""
    prefix = f"test-gw-{uuid.uuid4().hex[:10]}"
    yield prefix
    for key in conn.scan_iter(f"{prefix}:*"):
        conn.delete(key)


@pytest.fixture(scope="module")
def producer(conn, prefix):
    return Producer(conn, prefix=prefix)


@pytest.fixture(scope="module")
def registry(producer, adapter_dirs):
    """name -> registry record of each adapter."""
    return {name: producer.registry.add(name, path) for name, path in adapter_dirs.items()}


@pytest.fixture(scope="module")
def worker(redis_url, prefix, model, registry, conn, tmp_path_factory):
    proc = start_worker(redis_url, prefix, model, tmp_path_factory.mktemp("worker"))
    wait_until(lambda: conn.hlen(f"{prefix}:workers") >= 1 or proc.poll() is not None, "start")
    assert proc.poll() is None, "the worker exited"
    yield proc
    stop(proc)


@pytest.fixture(scope="module")
def gateway(redis_url, prefix, worker, tmp_path_factory):
    """The gateway's base URL, once /readyz says ready."""
    port = free_port()
    proc = start_gateway(redis_url, prefix, port, tmp_path_factory.mktemp("gateway"))
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        assert proc.poll() is None, "the gateway exited"
        try:
            return httpx.get(f"{url}/readyz", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    wait_until(ready, "the gateway being ready", timeout=60)
    yield url
    stop(proc)


@pytest.fixture(scope="module")
def client(gateway):
    import openai

    return openai.OpenAI(base_url=f"{gateway}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def llm(model):
    """The independent oracle: the engine's offline API in this process."""
    from lorapool import LLM

    return LLM(model, enable_lora=True, max_loras=2, max_lora_rank=8, max_num_seqs=8)


@pytest.fixture(scope="module")
def base_name(model):
    from pathlib import Path

    return Path(model).name
