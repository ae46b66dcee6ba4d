"""A job that comes while the engine steps runs in its next step.

A real Worker around the benchmark's stand-in engine (0.3 s steps, slots free) runs a
long job; a second job is submitted well into one of its steps. The worker reads new
entries between steps, so the second job's first token is the next step's. (When
the sender's round trip read them, at the start of a step, an entry that came after
that read waited a step more: read during the next step, it ran in the one after.)
The oracle is the stand-in's record of the step that made each request's first
token, and of when each step began and ended.
"""

import threading
import time

import pytest
import redis
from standin import load

from lorapool.lifecycle.chunk_log import log_chunks
from lorapool.protocol import SamplingParams
from lorapool.worker import Worker, WorkerConfig

pytestmark = pytest.mark.integration
LAYOUTS = ("standalone", "cluster")
STEP_S = 0.3


def _worker(conn, keys, step_s: float):
    """The benchmark module and a real Worker (burst: it stops once all is done) around
    its stand-in engine of 8 slots and ``step_s`` steps."""
    bench = load()
    config = WorkerConfig(
        prefix=keys.prefix, shards=keys.shards, name="busy", burst=True,
        audit_key=bench.AUDIT_KEY.encode(),
    )  # fmt: skip
    worker = Worker(bench.StandInEngine(8, step_s), conn, config, bench.BASE_MODEL)
    worker.ensure_group()
    return bench, worker


def test_a_job_that_comes_during_a_step_runs_in_the_next(conn, keys, producer):
    bench, worker = _worker(conn, keys, STEP_S)
    engine = worker.engine
    long = producer.submit(
        {"prompt_token_ids": [1]}, SamplingParams(max_tokens=12, ignore_eos=True)
    )
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while len(engine.steps) < 2:  # the long job runs, steps one after another
            assert thread.is_alive() and time.monotonic() < deadline
            time.sleep(0.01)
        seen = len(engine.steps)
        while len(engine.steps) == seen:  # a step has just begun ...
            time.sleep(0.002)
        time.sleep(STEP_S / 3)  # ... and is a third through
        submitted = time.perf_counter()
        short = producer.submit(
            {"prompt_token_ids": [1]}, SamplingParams(max_tokens=1, ignore_eos=True)
        )
    finally:
        thread.join(timeout=60)
    assert not thread.is_alive()
    (during,) = [i for i, s in enumerate(engine.steps) if s[0] <= submitted < s[1]]
    assert engine.first_step[short.request_id] == during + 1
    for handle, count in ((long, 12), (short, 1)):  # and both ran as the stand-in says
        rid = handle.request_id
        tokens = [t for c in log_chunks(conn, keys, rid) for o in c.outputs for t in o.token_ids]
        assert tokens == [bench.token_of(rid, k) for k in range(count)]


def test_redis_away_at_the_read_between_steps_loses_no_output(conn, keys, producer, monkeypatch):
    """The read between steps is made after the step, before its outputs are queued for
    the sender: Redis away there (a ConnectionError at the first such read) must cost no
    token of the running job, and the job that came meanwhile is read all the same (by
    the sender's round trip, then between later steps)."""
    bench, worker = _worker(conn, keys, STEP_S / 3)
    failed, real_read = [], worker.intake.read

    def read(plan, block, one_pass=False):
        if one_pass and not failed:
            producer.submit(  # a job comes, then Redis goes away under the read
                {"prompt_token_ids": [1]},
                SamplingParams(max_tokens=2, ignore_eos=True),
                request_id="second",
            )
            failed.append(True)
            raise redis.ConnectionError("Redis went away at the read between steps")
        return real_read(plan, block, one_pass)

    monkeypatch.setattr(worker.intake, "read", read)
    first = producer.submit(
        {"prompt_token_ids": [1]}, SamplingParams(max_tokens=6, ignore_eos=True)
    )
    thread = threading.Thread(target=worker.run)
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive() and failed == [True]
    for rid, count in ((first.request_id, 6), ("second", 2)):
        chunks = log_chunks(conn, keys, rid)
        tokens = [t for c in chunks for o in c.outputs for t in o.token_ids]
        assert tokens == [bench.token_of(rid, k) for k in range(count)]
        assert chunks[-1].finished and chunks[-1].error is None
