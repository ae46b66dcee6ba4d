"""A pool for the batch tests: real Redis, one lorapool worker process on the tiny model
with three adapters, and RQ workers (``rq worker``, JSON serializer) started per test.

Keys live under a prefix of the module's own and are deleted after it; the RQ queue is
named after the prefix, and its keys go too.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from gateway_procs import start_pool_worker, stop

from lorapool import SamplingParams
from lorapool.batch import BatchConfig, BatchService
from lorapool.producer import Producer
from lorapool.records.adapter import lora_from_record

ADAPTERS = {
    "ad-qv": ("q_proj", "v_proj"),
    "ad-mlp": ("gate_proj", "up_proj"),
    "ad-o": ("o_proj", "down_proj"),
}


@pytest.fixture(scope="module")
def prefix(conn):
    prefix = f"test-batch-{uuid.uuid4().hex[:10]}"
    yield prefix
    for key in conn.scan_iter(f"{prefix}:batch:*"):  # the RQ jobs of each batch
        batch_id = key.decode().split("{")[1].rstrip("}")
        for pattern in (f"rq:job:{batch_id}-*", f"rq:results:{batch_id}-*"):
            conn.delete(*conn.scan_iter(pattern), "_")
    conn.srem("rq:queues", f"rq:queue:{prefix}")
    for pattern in (f"{prefix}:*", f"rq:*{prefix}*"):
        for key in conn.scan_iter(pattern):
            if conn.type(key) == b"zset":  # an RQ registry (a webhook's retry, scheduled)
                for job in conn.zrange(key, 0, -1):
                    conn.delete(b"rq:job:" + job, b"rq:results:" + job)
            conn.delete(key)


@pytest.fixture(scope="module")
def registry(conn, prefix, model, tmp_path_factory):
    from adapters import build_adapter

    producer, root = Producer(conn, prefix=prefix), tmp_path_factory.mktemp("batch-adapters")
    return {
        name: producer.registry.add(
            name, build_adapter(model, root / name, rank=8, targets=t, seed=i, std=0.2)
        )
        for i, (name, t) in enumerate(ADAPTERS.items())
    }


@pytest.fixture(scope="module")
def worker(redis_url, prefix, model, registry, conn, tmp_path_factory):
    proc = start_pool_worker(conn, redis_url, prefix, model, tmp_path_factory.mktemp("worker"))
    yield proc
    stop(proc)


@pytest.fixture
def config(prefix, tmp_path):
    return BatchConfig(prefix=prefix, queue=prefix, poll_s=0.3)


@pytest.fixture
def service(conn, config):
    return BatchService(conn, config)


@pytest.fixture
def rq_worker(redis_url, config, tmp_path):
    """Start an RQ worker of the batch queue: ``rq_worker()`` -> its process."""
    procs = []

    def start(
        *extra: str, worker_class: str = "lorapool.batch.rq_worker.SimpleWorker"
    ) -> subprocess.Popen:
        cmd = [sys.executable, "-c", "from rq.cli import main; main()", "worker", config.queue,
               "--url", redis_url, "--serializer", "json", "--with-scheduler",
               "--worker-class", worker_class, "-q", *extra]  # fmt: skip
        cwd = Path(tmp_path) / f"rq-{len(procs)}"
        cwd.mkdir()
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen(cmd, cwd=cwd, env=env, start_new_session=True))
        return procs[-1]

    yield start
    for proc in procs:
        if proc.poll() is None:
            stop(proc)
        with contextlib.suppress(ProcessLookupError):  # a forking worker's work horse
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def llm(model):
    from lorapool import LLM

    return LLM(model, enable_lora=True, max_loras=3, max_lora_rank=8, max_num_seqs=8)


@pytest.fixture
def make_lines():
    return lines_of


def lines_of(
    count: int, models: list[str], max_tokens: int = 6, url: str = "/v1/completions"
) -> list[dict]:
    """Lines of one endpoint (a batch's lines must use its endpoint, as OpenAI's do),
    cycling through the models."""
    lines = []
    for i in range(count):
        body = {"model": models[i % len(models)], "max_tokens": max_tokens, "temperature": 0}
        if url == "/v1/chat/completions":
            body["messages"] = [{"role": "user", "content": f"question {i} about w{i % 7}"}]
        else:
            body["prompt"] = f"line {i}: the w{i % 5} and w{i % 3}"
        lines.append({"custom_id": f"req-{i}", "method": "POST", "url": url, "body": body})
    return lines


@pytest.fixture(scope="module")
def oracle(llm, registry, base_name):
    """A batch line's expected RequestOutput, from the engine's offline API (greedy)."""

    def expected(line: dict):
        body = line["body"]
        model = body["model"]
        lora = None if model == base_name else lora_from_record(registry[model])
        params = SamplingParams(temperature=0, max_tokens=body["max_tokens"])
        if "messages" in body:
            return llm.chat(body["messages"], params, lora_request=lora)[0]
        return llm.generate([body["prompt"]], params, lora_request=lora)[0]

    return expected
