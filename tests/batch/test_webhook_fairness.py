"""A tenant whose receiver hangs delays only its own callbacks.

Three RQ workers deliver; the dispatcher (``lorapool audit-writer``) allows a tenant
one delivery in flight, each attempt bounded at 3 s. Tenant B's 20 callbacks are timed
from each job's finish (``finished_at`` in the event, the worker's clock) to their
arrival at B's receiver: once with nothing else going on, once while tenant A's 20
callbacks hang at A's receiver (retried, so A keeps its slot busy throughout). B's p99
under A's hang must stay within twice its idle p99 (or a second past it, well under an
attempt's 3 s). With a single shared queue (no
lanes) A's hanging deliveries take every RQ worker for 3 s at a time, and B waits
seconds."""

from __future__ import annotations

import math

import orjson
import pytest
from gateway_procs import start_audit_writer, stop
from receivers import Receiver

from lorapool import SamplingParams
from lorapool.batch.webhook_secrets import WebhookSecrets
from lorapool.lifecycle.keys import Keys
from lorapool.producer import Producer

pytestmark = pytest.mark.usefixtures("worker")
COUNT = 20


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[math.ceil(0.99 * len(ordered)) - 1]


def _run(producer: Producer, tenant: str, tag: str, url: str) -> list:
    params = SamplingParams(max_tokens=4, temperature=0)
    return [
        producer.submit(
            f"{tag} {i}", params, None, f"{tenant}~{tag}-{i}", {"tenant": tenant}, on_finish=url
        )  # fmt: skip
        for i in range(COUNT)
    ]


def _latencies(receiver: Receiver) -> list[float]:
    hits = receiver.wait_for(COUNT, timeout=120)
    assert len(hits) == COUNT, f"{len(hits)} of {COUNT} callbacks arrived"
    return [h.at - orjson.loads(h.body)["data"]["finished_at"] for h in hits]


def test_a_hanging_receiver_delays_only_its_own_tenant(
    conn, prefix, redis_url, rq_worker, tmp_path, capsys
):
    store = WebhookSecrets(conn, Keys(prefix))
    store.current("tenant-a"), store.current("tenant-b")
    db = f"sqlite:///{tmp_path / 'audit.sqlite'}"
    flags = ("--callback-queue", prefix, "--webhook-allow", "127.0.0.1/32",
             "--webhook-deadline", "3", "--webhook-tenant-concurrency", "1")  # fmt: skip
    writer = start_audit_writer(redis_url, prefix, db, tmp_path, *flags)
    workers = [rq_worker() for _ in range(3)]
    producer = Producer(conn, prefix=prefix)
    try:
        with Receiver() as warm:  # RQ workers and the writer past their first job
            for h in _run(producer, "tenant-b", "warm", warm.url):
                h.result(timeout=120)
            warm.wait_for(COUNT, timeout=120)
        with Receiver() as idle_b:
            for h in _run(producer, "tenant-b", "idle", idle_b.url):
                h.result(timeout=120)
            idle = _latencies(idle_b)
        with Receiver("hang") as hanging_a, Receiver() as busy_b:
            for h in _run(producer, "tenant-a", "hang", hanging_a.url):
                h.result(timeout=120)
            assert hanging_a.wait_for(1, timeout=60), "A's first attempt never came"
            for h in _run(producer, "tenant-b", "busy", busy_b.url):
                h.result(timeout=120)
            busy = _latencies(busy_b)
            a_attempts = len(hanging_a.hits)
    finally:
        stop(writer)
        for w in workers:
            assert w.poll() is None, "an RQ worker exited"
    with capsys.disabled():
        print(f"\nB's callback latency p99: idle {p99(idle):.3f}s, while A hangs "
              f"{p99(busy):.3f}s; A's attempts meanwhile: {a_attempts}")  # fmt: skip
    assert a_attempts <= 1 + math.ceil(max(busy) / 3) + 1  # one slot: A never held two
    # the failure this guards costs B an attempt's 3 s deadline; a loaded 2-core box moves
    # one delivery of 20 (the p99 here is their max) by a few hundred ms (0.20 s against
    # an idle 0.09 s once, in a run beside other tests): bounded by a second past idle too
    assert p99(busy) <= max(2 * p99(idle), p99(idle) + 1.0), (sorted(idle), sorted(busy))
