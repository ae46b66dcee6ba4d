"""The audit writer killed (SIGKILL) mid-batch, again and again, as a node failure or an
OOM kill would: with the next batch read ahead and chained while the server inserts
this one, a kill can land in the COPY, between its end and its answer, before the
commit or before the ack. Each writer after it (the same consumer name, as a restarted
process on the same host; or a new one, as a rescheduled pod, which claims the dead
one's entries) stores every row once: the count, the chain, nothing pending or dead.
A real ``lorapool audit-writer`` process on the real Redis and database (SQLite and,
with ``LORAPOOL_TEST_PG_URL``, PostgreSQL)."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time

import pytest
from audit_fixtures import FAST_WRITER, KEY, make_adapter, make_record
from gateway_procs import lorapool_cmd
from sqlalchemy import text

from lorapool.audit_db import AuditWriter, WriterConfig, verify_chain

pytest_plugins = ["audit_fixtures"]
pytestmark = pytest.mark.integration
# more than five kills let the writers store: 500-800 rows a cycle on a loaded 2-core box,
# and all of 4,000 in five cycles on a fast one (SQLite, session 9)
RECORDS = 10_000
BATCH = 100


def _writer(audit_redis, target, consumer: str, tmp_path, log) -> subprocess.Popen:
    args = ["audit-writer", "--redis-url", audit_redis.url, "--prefix", audit_redis.prefix]
    args += [*target.cli_args(), "--consumer", consumer, "--batch-size", str(BATCH)]
    args += ["--claim-idle-ms", "300"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(lorapool_cmd(*args), cwd=tmp_path, env=env, stderr=log)


def _wait_for_more_rows(target, than: int, proc: subprocess.Popen, timeout=60.0) -> int:
    deadline = time.monotonic() + timeout
    while (count := target.count()) <= than:
        assert proc.poll() is None, "the writer exited before it stored a row"
        assert time.monotonic() < deadline, "the writer stored nothing"
        time.sleep(0.01)
    return count


def test_writers_killed_mid_batch_leave_every_row_stored_once(audit_target, audit_redis, tmp_path):
    rng = random.Random(5)
    adapters = [None, make_adapter("lora-a", 1), make_adapter("lora-b", 2)]
    records = [make_record(i, adapter=rng.choice(adapters)) for i in range(RECORDS)]
    audit_redis.publish(records)
    kills, stored = 0, 0
    for consumer in ["w-a", "w-a", "w-b", "w-c", "w-a"]:
        with open(tmp_path / f"{consumer}.log", "ab") as log:
            proc = _writer(audit_redis, audit_target, consumer, tmp_path, log)
        try:
            stored = _wait_for_more_rows(audit_target, stored, proc)
            time.sleep(rng.uniform(0, 0.1))  # somewhere in the next batches
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=10)
        kills += 1
        stored = audit_target.count()
        if stored == RECORDS:
            break
    assert kills >= 3 and stored < RECORDS, "the writers finished before enough kills"
    time.sleep(0.4)  # past --claim-idle-ms: the dead writers' entries are claimable
    config = WriterConfig(
        prefix=audit_redis.prefix, consumer="w-last", claim_idle_ms=300, **FAST_WRITER
    )
    stats = AuditWriter(audit_redis.conn, audit_target.engine, config).run(burst=True)
    assert stats.dead_lettered == 0
    assert audit_target.count() == RECORDS and audit_redis.pending() == 0
    with audit_target.engine.connect() as conn:
        distinct = conn.execute(text("SELECT count(DISTINCT request_id) FROM completions"))
        assert distinct.scalar() == RECORDS
    report = verify_chain(audit_target.engine, key=KEY)
    assert report.ok, report
