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

from lorapool.lifecycle.chunk_log import log_chunks
from lorapool.lifecycle.keys import WORKERS_GROUP
from lorapool.lifecycle.submit import build_job
from lorapool.producer import Producer
from lorapool.protocol import LoRARequest, SamplingParams
from lorapool.records.audit import record_from_dict
from lorapool.records.job import encode_job
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
    return [t for c in log_chunks(conn, keys, rid) for o in c.outputs for t in o.token_ids]


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
    assert conn.hget(keys.run("a"), "status") == b"finished"  # the run key is the workers'
    assert conn.hget(keys.run("a"), "result")
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


def make_worker(conn, keys, name: str) -> Worker:
    config = WorkerConfig(
        prefix=keys.prefix, name=name, audit_key=bench.AUDIT_KEY.encode(), lease_s=2, block_ms=50
    )
    worker = Worker(bench.StandInEngine(8, 0.002), conn, config, bench.BASE_MODEL)
    worker.ensure_group()
    return worker


def test_a_request_id_runs_once_whatever_entries_name_it(conn, keys, producer):
    """Issue 31 row C: the same request id XADDed again while it runs (read by the
    worker that runs it, and by another one) and after it finished: each duplicate is
    acked without output; one gap-free log with one final chunk, one audit record,
    nothing pending, the handle gets the one output."""
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    prompt = {"prompt_token_ids": [1, 2, 3]}
    handle = producer.submit(prompt, params, request_id="dup")
    duplicate = {"data": encode_job(build_job(prompt, params, None, "dup", None))}
    w1, w2 = make_worker(conn, keys, "w1"), make_worker(conn, keys, "w2")
    try:
        run_until(w1, lambda: conn.llen(keys.out("dup")) >= 2)
        conn.xadd(keys.requests, duplicate)  # w1 runs it and reads this too
        run_until(w1, lambda: conn.xlen(keys.requests) and settled_but(conn, keys, 1))
        conn.xadd(keys.requests, duplicate)  # w2 reads it while w1 runs
        run_until(w2, lambda: settled_but(conn, keys, 1))
        both = lambda: [w.run_guarded() for w in (w1, w2)]  # noqa: E731
        deadline = time.monotonic() + 30
        while not ("dup" in audit(conn, keys) and settled(conn, keys)):
            assert time.monotonic() < deadline
            both()
        conn.xadd(keys.requests, duplicate)  # after it finished
        deadline = time.monotonic() + 10
        while conn.xpending(keys.requests, WORKERS_GROUP)["pending"] or lag(conn, keys):
            assert time.monotonic() < deadline
            both()
        assert not w1.stopped and not w2.stopped
    finally:
        w1.teardown()
        w2.teardown()
    chunks = log_chunks(conn, keys, "dup")
    assert [c.seq for c in chunks] == list(range(len(chunks)))
    assert [c.finished for c in chunks].count(True) == 1 and chunks[-1].finished
    assert tokens(conn, keys, "dup") == [bench.token_of("dup", k) for k in range(60)]
    assert len(audit(conn, keys)["dup"]) == 1
    assert conn.xlen(keys.dead) == 0
    assert handle.result(timeout=5).outputs[0].token_ids == tokens(conn, keys, "dup")


def settled_but(conn, keys, running: int) -> bool:
    """Only ``running`` entries pending, none unread."""
    return conn.xpending(keys.requests, WORKERS_GROUP)["pending"] == running and not lag(conn, keys)


def lag(conn, keys) -> int:
    groups = {g["name"]: g for g in conn.xinfo_groups(keys.requests)}
    return groups[WORKERS_GROUP.encode()]["lag"] or 0


def _fail_with(conn, keys, rids, operator_action, text: str) -> None:
    """Jobs running on a worker when ``operator_action`` removes their entries: each
    ends with a final error chunk naming the removal, one audit record with
    finish_reason "error"; the worker goes on and runs the next job."""
    params = SamplingParams(max_tokens=2000, ignore_eos=True)
    worker = make_worker(conn, keys, "w")
    producer = Producer(conn, prefix=keys.prefix, shards=keys.shards)
    try:
        handles = producer.submit_many(
            [{"prompt_token_ids": [1]}] * len(rids), params, request_ids=rids
        )
        run_until(worker, lambda: all(conn.llen(keys.out(r)) >= 2 for r in rids))
        operator_action()
        run_until(worker, lambda: all(r in audit(conn, keys) for r in rids), timeout=15)
        after = producer.submit({"prompt_token_ids": [1]}, PARAMS, request_id="after")
        run_until(worker, lambda: "after" in audit(conn, keys))
    finally:
        worker.teardown()
    records = audit(conn, keys)
    for rid, handle in zip(rids, handles):
        chunks = log_chunks(conn, keys, rid)
        assert [c.finished for c in chunks].count(True) == 1 and chunks[-1].finished
        assert text in chunks[-1].error and "removed" in chunks[-1].error
        assert [o.finish_reason for o in records[rid][0].outputs] == ["error"]
        assert len(records[rid]) == 1
        assert handle.result(timeout=5).error == chunks[-1].error
    assert after.result(timeout=5).outputs[0].token_ids == [
        bench.token_of("after", k) for k in range(12)
    ]
    assert settled(conn, keys)


def test_an_xtrim_under_running_jobs_ends_them_visibly(conn, keys):
    """Issue 31 row B: XTRIM MAXLEN 0 while jobs run."""
    _fail_with(conn, keys, ["t0", "t1", "t2"], lambda: conn.xtrim(keys.requests, maxlen=0), "XTRIM")


def test_a_group_destroyed_and_recreated_under_running_jobs_ends_them_visibly(conn, keys):
    def reset():
        conn.xgroup_destroy(keys.requests, WORKERS_GROUP)
        conn.xgroup_create(keys.requests, WORKERS_GROUP, id="$")

    _fail_with(conn, keys, ["g0", "g1"], reset, "XGROUP")


def test_the_stream_deleted_under_running_jobs_ends_them_visibly(conn, keys):
    _fail_with(conn, keys, ["d0"], lambda: conn.delete(keys.requests), "DEL")


def test_safe_trim_keeps_what_is_queued_or_running(conn, keys):
    """`lorapool trim`: the acked entries go, the pending and the unread ones stay."""
    from lorapool.lifecycle.trim import safe_trim

    for i in range(5):
        raw_submit(conn, keys, f"s{i}")
    conn.xgroup_create(keys.requests, WORKERS_GROUP, id="0")
    read = conn.xreadgroup(WORKERS_GROUP, "w", {keys.requests: ">"}, count=3)[0][1]
    conn.xack(keys.requests, WORKERS_GROUP, read[0][0], read[2][0])  # the 2nd pending
    assert safe_trim(conn, keys)[keys.requests] == 1
    left = [entry_id for entry_id, _ in conn.xrange(keys.requests)]
    assert left[0] == read[1][0] and len(left) == 4


def test_a_reader_whose_marker_and_log_vanish_gets_job_lost_within_seconds(conn, keys, producer):
    """Issue 31 row E: the marker and the log deleted while a reader waits (as a Redis
    restart without persistence leaves them): JobLost at its next read, not at its
    timeout; the async reader too."""
    import asyncio
    import threading

    from lorapool.producer import AsyncProducer, JobLost

    handle = producer.submit({"prompt_token_ids": [1]}, PARAMS, request_id="lost")
    threading.Timer(0.5, conn.delete, args=[keys.job("lost")]).start()
    started = time.monotonic()
    with pytest.raises(JobLost, match="lost: its job marker and chunk log are gone"):
        handle.result(timeout=60)
    assert time.monotonic() - started < 5

    async def follow():
        aproducer = AsyncProducer(pool_url_of(conn), prefix=keys.prefix, shards=keys.shards)
        try:
            await (await aproducer.handle("lost")).result(timeout=60)
        finally:
            await aproducer.aclose()

    started = time.monotonic()
    with pytest.raises(JobLost):
        asyncio.run(follow())
    assert time.monotonic() - started < 5


def pool_url_of(conn) -> str:
    kw = conn.connection_pool.connection_kwargs
    if kw.get("path"):  # the embedded server of a machine with no Redis: a unix socket
        return f"unix://{kw['path']}?db={kw.get('db', 0)}"
    return f"redis://{kw.get('host', '127.0.0.1')}:{kw.get('port', 6379)}/{kw.get('db', 0)}"


def test_redis_restarted_without_persistence(tmp_path):
    """A private redis-server without AOF or RDB, restarted under a waiting reader:
    JobLost within seconds; ``persistence_warning`` says what a restart loses."""
    import threading

    from redis_server import RedisServer

    from lorapool.persistence import persistence_warning
    from lorapool.producer import JobLost

    server = RedisServer(tmp_path, args=("--appendonly", "no", "--save", "")).start()
    try:
        producer = Producer(server.url, prefix="np")
        assert "no persistence" in persistence_warning(producer.redis)
        handle = producer.submit({"prompt_token_ids": [1]}, PARAMS, request_id="r")

        def restart():
            server.kill()
            server.start()

        threading.Timer(0.3, restart).start()
        started = time.monotonic()
        with pytest.raises(JobLost):
            handle.result(timeout=60)
        assert time.monotonic() - started < 8
    finally:
        server.stop()


def test_minor_ones(conn, keys, producer, worker):
    """Issue 31 row F: an abort for an unknown id expires in minutes (a known one's
    outlives the request); a job nested past the parser's depth whose id is readable
    gets its final error chunk."""
    producer.abort("nobody")
    assert 0 < conn.ttl(keys.abort("nobody")) <= 300
    producer.submit({"prompt_token_ids": [1]}, PARAMS, request_id="known")
    producer.abort("known")
    assert conn.ttl(keys.abort("known")) > 3600
    deep = b'{"v": 1, "request_id": "deep", "prompt": ' + b"[" * 3000 + b"]" * 3000 + b"}"
    entry = conn.xadd(keys.requests, {"data": deep}).decode()
    run_until(worker, lambda: "deep" in audit(conn, keys) and settled(conn, keys))
    final = log_chunks(conn, keys, "deep")[-1]
    assert final.finished and final.error
    assert entry in dead(conn, keys)
