"""Queue integrity (issue 31) against real Redis: what a producer or an operator may do
to the pool's keys ends one request, never a worker.

A real ``Worker`` (its loop, ``run_guarded``, as ``lorapool worker`` runs it) around
the benchmark's stand-in engine, whose output (``token_of``) is the oracle. Jobs go in
as a hostile producer would put them: raw XADDs of the wire record, and keys it may
write (docs/redis-acl.md) set to values of another type first.
"""

from __future__ import annotations

import time

import orjson
import pytest
from standin import load

from lorapool.audit_record import record_from_dict
from lorapool.lifecycle.chunk_log import log_chunks
from lorapool.lifecycle.keys import WORKERS_GROUP
from lorapool.lifecycle.submit import build_job
from lorapool.lifecycle.wire import encode_job
from lorapool.protocol import LoRARequest, SamplingParams
from lorapool.worker import Worker, WorkerConfig

pytestmark = pytest.mark.integration
PARAMS = SamplingParams(max_tokens=12, ignore_eos=True)
bench = load()


@pytest.fixture
def worker(conn, keys):
    config = WorkerConfig(
        prefix=keys.prefix, name="w", audit_key=bench.AUDIT_KEY.encode(), lease_s=2
    )
    worker = Worker(bench.StandInEngine(8, 0.002), conn, config, bench.BASE_MODEL)
    worker.ensure_group()
    yield worker
    worker.teardown()


def raw_submit(conn, keys, rid: str, lora: LoRARequest | None = None) -> str:
    """The wire record of a valid job, XADDed as a producer's script would (no marker)."""
    job = build_job({"prompt_token_ids": [1, 2, 3]}, PARAMS, lora, rid, None)
    return conn.xadd(keys.for_request(rid).requests, {"data": encode_job(job)}).decode()


def run_until(worker, done, timeout: float = 20.0) -> None:
    """The worker's loop (never raises) until ``done()``."""
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "the worker did not get there"
        worker.run_guarded()
        assert not worker.stopped


def audit(conn, keys) -> dict[str, list]:
    records: dict[str, list] = {}
    for _, fields in conn.xrange(keys.audit):
        record = record_from_dict(orjson.loads(fields[b"data"]))
        records.setdefault(record.request_id, []).append(record)
    return records


def dead(conn, keys) -> dict[str, str]:
    return {f[b"entry"].decode(): f[b"reason"].decode() for _, f in conn.xrange(keys.dead)}


def settled(conn, keys) -> bool:
    return conn.xpending(keys.requests, WORKERS_GROUP)["pending"] == 0


def tokens(conn, keys, rid: str) -> list[int]:
    return [t for c in log_chunks(conn, keys, rid) for o in c.outputs for t in o["token_ids"]]


def test_a_job_marker_of_another_type_ends_its_request_not_the_worker(conn, keys, worker):
    """Issue 31 row A: SET {p}:job:<id> x, then an XADD of a job with that id."""
    conn.set(keys.job("a"), "x")
    raw_submit(conn, keys, "a")
    run_until(worker, lambda: "a" in audit(conn, keys) and settled(conn, keys))
    chunks = log_chunks(conn, keys, "a")
    assert [c.seq for c in chunks] == list(range(len(chunks)))
    assert [c.finished for c in chunks].count(True) == 1 and chunks[-1].finished
    assert tokens(conn, keys, "a") == [bench.token_of("a", k) for k in range(12)]
    assert conn.get(keys.job("a")) == b"x"  # not the pool's: left alone
    assert conn.ttl(keys.out("a")) > 60  # the log is its only record
    assert len(audit(conn, keys)["a"]) == 1


def test_a_chunk_log_of_another_type_fails_its_request_alone(conn, keys, worker):
    """The log key a string before the job runs, and another replaced while its job
    runs: each request fails (ack, audit record with finish_reason "error", a dead
    letter naming WRONGTYPE), a good job beside them completes, the worker goes on."""
    conn.set(keys.out("b"), "x")
    entry_b = raw_submit(conn, keys, "b")
    entry_c = raw_submit(conn, keys, "c")
    run_until(worker, lambda: conn.llen(keys.out("c")) >= 2)
    conn.delete(keys.out("c"))
    conn.set(keys.out("c"), "x")
    raw_submit(conn, keys, "good")
    run_until(worker, lambda: len(audit(conn, keys)) == 3 and settled(conn, keys))
    records, reasons = audit(conn, keys), dead(conn, keys)
    for rid, entry in (("b", entry_b), ("c", entry_c)):
        assert "WRONGTYPE" in reasons[entry] and keys.out(rid) in reasons[entry]
        assert [o.finish_reason for o in records[rid][0].outputs] == ["error"]
        assert len(records[rid]) == 1
        assert conn.get(keys.out(rid)) == b"x"
    assert tokens(conn, keys, "good") == [bench.token_of("good", k) for k in range(12)]


def test_registry_and_pool_keys_of_another_type(conn, keys, worker):
    """{p}:adapters and {p}:workers, which a producer may write, set to strings: a job
    for an adapter fails alone (its error names the key's refusal), the heartbeat goes
    on without a pool view, a plain job completes."""
    conn.set(keys.adapters, "x")
    conn.set(keys.workers, "x")
    entry = raw_submit(conn, keys, "lora", LoRARequest("ad", 1, "/nowhere"))
    raw_submit(conn, keys, "plain")
    run_until(worker, lambda: len(audit(conn, keys)) == 2 and settled(conn, keys))
    worker.heartbeat()
    assert "WRONGTYPE" in dead(conn, keys)[entry]
    assert tokens(conn, keys, "plain") == [bench.token_of("plain", k) for k in range(12)]
    final = log_chunks(conn, keys, "lora")[-1]
    assert final.finished and "WRONGTYPE" in final.error
