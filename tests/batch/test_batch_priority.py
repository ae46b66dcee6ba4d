"""Batch lines do not starve interactive traffic: 20 interactive jobs submitted while a
2,000-line batch runs get their first token about as soon as on an idle pool (issue 18
asks p50 within 2x; the test asserts a looser bound, the measured ratio goes to
benchmarks/RESULTS.md)."""

from __future__ import annotations

import io
import statistics
import time

import orjson
import pytest

from lorapool import SamplingParams
from lorapool.producer import Producer

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("worker")]


def ttft_p50(producer: Producer, tag: str) -> float:
    params = SamplingParams(max_tokens=8, temperature=0)
    handles = producer.submit_many([f"interactive {tag} {i}" for i in range(20)], params)
    outputs = [h.result(timeout=120) for h in handles]
    return statistics.median(o.metrics.first_token_time - o.metrics.arrival_time for o in outputs)


def test_interactive_ttft_while_a_batch_runs(
    make_lines, service, rq_worker, registry, conn, prefix, capsys
):
    producer = Producer(conn, prefix=prefix)
    ttft_p50(producer, "warm-up")
    idle = ttft_p50(producer, "idle")
    lines = make_lines(2000, list(registry), max_tokens=16)
    data = b"".join(orjson.dumps(x) + b"\n" for x in lines)
    batch = service.create(service.upload(io.BytesIO(data), "in.jsonl")["id"], "/v1/completions")
    rq_worker()
    deadline = time.monotonic() + 120
    while service.retrieve(batch["id"])["request_counts"]["completed"] < 50:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    busy = ttft_p50(producer, "busy")
    still = service.retrieve(batch["id"])
    service.cancel(batch["id"])
    with capsys.disabled():
        print(f"\nTTFT p50 idle {idle * 1000:.1f} ms, beside a 2,000-line batch "
              f"{busy * 1000:.1f} ms ({busy / idle:.2f}x); batch at "
              f"{still['request_counts']['completed']} lines")  # fmt: skip
    assert still["request_counts"]["completed"] < 2000  # the batch was still running
    assert busy <= 4 * idle + 0.1
