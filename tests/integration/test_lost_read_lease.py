"""Entries a read delivered but the worker never started are not renewed for ever.

The renewer (``worker/renewer.py``) renews the entries a read delivered from the
moment the read returns (``Unstarted``) until the worker's thread starts them. When
the trip that read them fails after its read (an upkeep call of the trip meets Redis
away), the worker's thread never gets them: they are pending to this consumer and,
by design, claimed after the lease by whichever worker reads next. They were renewed
for ever instead, so a live worker held them pending and idle-less for good (the
stateful queue test's long run found one never settled). The same for entries of a
read the worker's thread fails to start mid-way (Redis away at the third of five).
Real Redis, the real worker and publisher, the benchmark's engine stand-in.
"""

import pytest
import redis
from standin import load

from lorapool.protocol import SamplingParams
from lorapool.worker import Worker, WorkerConfig
from lorapool.worker.publisher import _Trip
from lorapool.worker.renewer import Unstarted

pytestmark = pytest.mark.integration
PROMPT = {"prompt_token_ids": [1, 2, 3]}


def _worker(conn, keys):
    bench = load()
    config = WorkerConfig(
        prefix=keys.prefix,
        shards=keys.shards,
        name="w",
        audit_key=bench.AUDIT_KEY.encode(),
        lease_s=1,
        block_ms=10,
    )
    worker = Worker(bench.StandInEngine(max_num_seqs=8, step_s=0.0), conn, config, bench.BASE_MODEL)
    worker.ensure_group()
    return worker


def _unstarted(worker) -> list:
    with worker.state.leases.renewing() as entries:
        return [e for e in entries if isinstance(e, Unstarted)]


def test_a_trip_that_fails_after_its_read_leaves_nothing_to_renew(conn, keys, producer):
    worker = _worker(conn, keys)
    producer.submit_many([PROMPT] * 3, SamplingParams(max_tokens=2), request_ids=["a", "b", "c"])

    def redis_away():
        raise redis.ConnectionError("Redis went away after the trip's read")

    trip = _Trip(outputs=[], read=worker.intake.plan(3), extra=[(redis_away, None)])
    with pytest.raises(redis.ConnectionError):
        worker.publisher._send_trip(trip)
    pending = sum(
        conn.xpending(s, "workers")["pending"] for k in keys.shard_views for s in k.streams
    )
    assert pending == 3  # the read did deliver them: claimed after the lease
    assert _unstarted(worker) == []  # and never renewed
    worker.teardown()


def test_a_read_whose_start_fails_midway_leaves_nothing_to_renew(conn, keys, producer, monkeypatch):
    worker = _worker(conn, keys)
    ids = [f"r{i}" for i in range(5)]
    producer.submit_many([PROMPT] * 5, SamplingParams(max_tokens=2), request_ids=ids)
    entries = worker.intake.read(worker.intake.plan(5), None)
    for stream, entry_id, *_ in entries:  # as the sender registers what it read
        worker.state.leases.add(Unstarted(stream, entry_id.decode()))
    started = []
    real_start = worker.start

    def start(entry_id, fields, **kw):
        if len(started) == 2:
            raise redis.ConnectionError("Redis went away at the third start")
        started.append(entry_id)
        return real_start(entry_id, fields, **kw)

    monkeypatch.setattr(worker, "start", start)
    with pytest.raises(redis.ConnectionError):
        worker._start_read(entries)
    assert len(entries) == 5 and len(started) == 2
    assert _unstarted(worker) == []  # the three not started are claimed after the lease
    worker.teardown()
