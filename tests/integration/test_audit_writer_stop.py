"""Issue 48 E: a writer stopped mid-batch (SIGSTOP: a frozen VM, a partition) holds up
the trail at most ``--db-stall-timeout`` seconds.

Two real ``lorapool audit-writer`` processes share one stream and one PostgreSQL
schema. The first is stopped at a moment it holds the chain lock inside an open
write transaction (found in ``pg_locks`` by its application name). The second used
to write nothing while it stayed stopped (it queued behind the lock; the stopped
one sat in its transaction). Now the server ends the stopped one's transaction
after the stall timeout (its batch rolls back), the second takes the lock and goes
on (10 s here; within 45 s, below), and once the first wakes and both drain the stream every row is
stored once, nothing is pending or dead, and the chain verifies.

PostgreSQL only: a SQLite writer's lock is a lock on a file, which nothing but its
holder can give back.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time

import pytest
from audit_fixtures import KEY, make_adapter, make_record
from gateway_procs import lorapool_cmd
from sqlalchemy import text

from lorapool.audit_db import verify_chain

pytest_plugins = ["audit_fixtures"]
pytestmark = pytest.mark.integration
RECORDS, BATCH = 6_000, 100
# The other writer takes the stopped one's entries at its next claim (--claim-every, 10 s;
# they must have idled --claim-idle-ms) and gets the lock when the server ends the stopped
# transaction (--db-stall-timeout, 10 s): up to ~20 s, 10 s when it already waits on the
# lock (the usual case here). CI's loaded 2-core box once took over 30 s.
RESUMED_WITHIN_S = 45.0
HOLDS_LOCK = text(
    "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a USING (pid) "
    "WHERE l.locktype = 'advisory' AND l.granted AND a.application_name = :name"
)


def _writer(audit_redis, target, consumer: str, tmp_path) -> subprocess.Popen:
    args = ["audit-writer", "--redis-url", audit_redis.url, "--prefix", audit_redis.prefix]
    args += [*target.cli_args(), "--consumer", consumer, "--batch-size", str(BATCH)]
    args += ["--claim-idle-ms", "2000", "--db-stall-timeout", "10"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(tmp_path / f"{consumer}.log", "ab") as log:
        return subprocess.Popen(lorapool_cmd(*args), cwd=tmp_path, env=env, stderr=log)


def _wait(what: str, ok, procs, timeout: float) -> float:
    start = time.monotonic()
    while not ok():
        for proc in procs:
            assert proc.poll() is None, f"a writer exited while waiting for {what}"
        assert time.monotonic() - start < timeout, f"no {what} within {timeout:.0f}s"
        time.sleep(0.05)
    return time.monotonic() - start


def _stop_holding_the_lock(proc, target, name: str, rng) -> bool:
    """SIGSTOP ``proc`` at a moment its transaction holds the chain lock."""
    for _ in range(200):
        proc.send_signal(signal.SIGSTOP)
        time.sleep(0.02)
        with target.engine.connect() as conn:
            if conn.execute(HOLDS_LOCK, {"name": name}).scalar():
                return True
        proc.send_signal(signal.SIGCONT)
        time.sleep(rng.uniform(0, 0.05))
    return False


@pytest.mark.parametrize("audit_location", ["postgresql"], indirect=True)
def test_a_writer_stopped_holding_the_lock_holds_the_other_up_briefly(
    audit_target, audit_redis, tmp_path
):
    rng = random.Random(7)
    adapters = [None, make_adapter("lora-a", 1)]
    audit_redis.publish([make_record(i, adapter=rng.choice(adapters)) for i in range(RECORDS)])
    stopped = _writer(audit_redis, audit_target, "w-stopped", tmp_path)
    other = _writer(audit_redis, audit_target, "w-other", tmp_path)
    procs = [stopped, other]
    try:
        _wait("first rows", lambda: audit_target.count() > 0, procs, 60)
        name = "lorapool audit-writer w-stopped"
        assert _stop_holding_the_lock(stopped, audit_target, name, rng), "never caught the lock"
        before = audit_target.count()
        waited = _wait(
            "rows from the other writer",
            lambda: audit_target.count() > before,
            [other],
            RESUMED_WITHIN_S,
        )
        print(f"the other writer stored rows {waited:.1f}s after the stop")
        stopped.send_signal(signal.SIGCONT)
        _wait("every row", lambda: audit_target.count() == RECORDS, procs, 120)
        _wait("nothing pending", lambda: audit_redis.pending() == 0, procs, 60)
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGCONT)
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    assert audit_redis.dead() == []
    with audit_target.engine.connect() as conn:
        distinct = conn.execute(text("SELECT count(DISTINCT request_id) FROM completions"))
        assert distinct.scalar() == RECORDS
    report = verify_chain(audit_target.engine, key=KEY)
    assert report.ok, report
