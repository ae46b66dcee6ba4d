"""A pool for the gateway's tests: real Redis, a worker process on the tiny model with
two adapters, and ``lorapool serve`` under uvicorn on a free port of 127.0.0.1.

One pool per test module (starting a worker takes seconds on a shared CPU); each
module's keys live under their own prefix and are deleted after it.
"""

from __future__ import annotations

import uuid

import pytest
from gateway_procs import serve, start_pool_worker, stop

from lorapool.producer import Producer

ADAPTERS = {"ad-qv": ("q_proj", "v_proj"), "ad-mlp": ("gate_proj", "up_proj")}


@pytest.fixture(scope="module")
def adapter_dirs(model, tmp_path_factory):
    from adapters import build_adapter

    root = tmp_path_factory.mktemp("gateway-adapters")
    return {
        name: build_adapter(model, root / name, rank=8, targets=t, seed=i, std=0.2)
        for i, (name, t) in enumerate(ADAPTERS.items())
    }


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
    proc = start_pool_worker(conn, redis_url, prefix, model, tmp_path_factory.mktemp("worker"))
    yield proc
    stop(proc)


@pytest.fixture(scope="module")
def gateway(redis_url, prefix, worker, tmp_path_factory):
    """The gateway's base URL, once /readyz?min_workers=1 says a worker serves."""
    url, proc = serve(
        redis_url, prefix, tmp_path_factory.mktemp("gateway"), path="/readyz?min_workers=1"
    )
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
def scraper(conn, prefix) -> dict:
    """The headers Prometheus scrapes a gateway's /metrics with: an audit key's (the
    route answers only audit and admin keys)."""
    from lorapool.lifecycle.keys import Keys
    from lorapool.producer.api_keys import ApiKeys

    _, key = ApiKeys(conn, Keys(prefix)).add("ops", "audit", all_tenants=True)
    return {"Authorization": f"Bearer {key}"}
