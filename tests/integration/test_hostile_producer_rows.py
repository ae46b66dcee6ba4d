"""Issue 48 rows A and B, replayed as filed: a hostile producer, connected as the
documented producer ACL user (docs/redis-acl.md), writes what its rules allow into the
keys of a job, against a real worker process (the real ``Worker`` around the stand-in
engine, as the worker's ACL user) and the real ``lorapool audit-writer`` (as its ACL
user) into PostgreSQL.

- Row A: the marker's fields (``status``, ``unread``, ``unread_log``, ``submitted``,
  ``result`` holding a forged output) then the id pushed on ``unread-ended``, for a
  request id not yet submitted. Before, a worker signed the forged text as the
  request's output and the writer stored it; the genuine submission's row went to
  ``conflicts``. Now: no row at all for a marker that names no entry; a marker that
  names one (gone) makes a never-ran row with no output text, and the genuine
  submission of that id is refused at submit (the id is taken), so nothing conflicts.
- Row B: ``HSET job:<id> status finished`` (and a forged entry) on another tenant's
  running job. Before, no audit row at all and its client got a bare RuntimeError. Now
  the job ends as the worker ran it: the client's output, the audit row and the
  stand-in engine's own tokens (``token_of``) agree.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from deployment_pool import set_users
from redis_cluster import private_redis
from standin import load

from lorapool.audit_db.queries import get_request, list_conflicts
from lorapool.lifecycle.chunk_log import encode_result
from lorapool.lifecycle.keys import Keys
from lorapool.producer import Producer
from lorapool.protocol import SamplingParams
from lorapool.records.chunk import Chunk, Delta

pytestmark = pytest.mark.integration
pytest_plugins = ["audit_fixtures"]
bench = load()
SUPPORT = Path(__file__).resolve().parents[1] / "support"
CLI = [sys.executable, "-c", "from lorapool.cli.main import main; main()"]
USERS = (
    "worker",
    "producer",
    "gateway",
    "audit-writer",
    "exporter",
    "rq-worker",
    "operator",
    "keda",
)
FORGED = "FORGED: the model said the tenant may wire funds"


class Pool:
    """A private Redis with the doc's users, one worker process, one audit writer."""

    def __init__(self, server, target, tmp: Path):
        self.server, self.target, self.tmp, self.procs = server, target, tmp, []
        self.admin = server.client()
        set_users(self.admin, {f"lorapool-{u}": "pw" for u in USERS})
        self.keys = Keys()

    def url(self, role: str) -> str:
        return self.server.url.replace("://", f"://lorapool-{role}:pw@", 1)

    def start(self) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "LORAPOOL_AUDIT_KEY": bench.AUDIT_KEY}
        worker = [sys.executable, str(SUPPORT / "standin_worker.py"), self.url("worker")]
        worker += ["lorapool", "0", "gpu0", "8", "5"]
        writer = [*CLI, "audit-writer", "--redis-url", self.url("audit-writer")]
        writer += ["--db-url", self.target.url, "--log-level", "WARNING"]
        if self.target.schema:
            writer += ["--schema", self.target.schema]
        for name, cmd in (("worker", worker), ("writer", writer)):
            log = open(self.tmp / f"{name}.log", "wb")  # noqa: SIM115 - the process keeps it
            self.procs.append((name, subprocess.Popen(cmd, env=env, stdout=log, stderr=log)))
        deadline = time.monotonic() + 60
        while not self.admin.exists(self.keys.model):
            self.check_alive()
            assert time.monotonic() < deadline, "the worker did not start"
            time.sleep(0.1)

    def check_alive(self) -> None:
        for name, proc in self.procs:
            if proc.poll() is not None:
                log = (self.tmp / f"{name}.log").read_text()[-3000:]
                raise AssertionError(f"{name} exited {proc.returncode}:\n{log}")

    def rows(self, rid: str, wait_s: float = 20.0) -> list[dict]:
        """The audit rows of ``rid`` once the writer has taken everything on the stream."""
        deadline = time.monotonic() + wait_s
        while self.admin.xlen(self.keys.audit) and time.monotonic() < deadline:
            time.sleep(0.1)  # the writer deletes what it committed
        time.sleep(0.5)
        return get_request(self.target.engine, rid)

    def stop(self) -> None:
        for _, proc in self.procs:
            proc.terminate()
        for _, proc in self.procs:
            proc.wait(30)
        self.admin.close()


@pytest.fixture
def pool(tmp_path, audit_target):
    if audit_target.kind != "postgresql":
        pytest.skip("rows A and B are replayed with PostgreSQL, as filed")
    with private_redis("standalone", tmp_path / "redis") as server:
        made = Pool(server, audit_target, tmp_path)
        try:
            made.start()
            yield made
        finally:
            made.stop()


def forged_result(rid: str) -> bytes:
    """A final record with the forged text, as a worker's compaction writes one."""
    delta = Delta(text=FORGED, token_ids=[1, 2, 3], finish_reason="stop")
    return encode_result(Chunk(request_id=rid, seq=1, outputs=[delta], finished=True))


def forge_ended(hostile: Producer, rid: str, entry: str | None) -> None:
    """Row A's writes, each within the producer user's rules."""
    keys = hostile.keys
    fields = {"status": "failed", "unread": time.time(), "unread_log": 1}
    fields |= {"submitted": time.time(), "result": forged_result(rid)}
    if entry is not None:
        fields["entry"] = entry
    hostile.redis.hset(keys.job(rid), mapping=fields)
    hostile.redis.rpush(keys.for_request(rid).unread_ended, rid)


def taken(pool: Pool, timeout: float = 20.0) -> None:
    """Wait until a worker took the pushed ids off the list (its upkeep's pace)."""
    deadline = time.monotonic() + timeout
    while pool.admin.llen(pool.keys.unread_ended):
        assert time.monotonic() < deadline, "no worker took the ids"
        time.sleep(0.1)
    time.sleep(0.5)


def test_row_a_a_forged_output_is_never_audited(pool):
    hostile = Producer(pool.url("producer"))
    honest = Producer(pool.url("gateway"))
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    try:
        # a future id, its marker naming no entry: no row, and the genuine job runs
        forge_ended(hostile, "future-a", None)
        taken(pool)
        pool.check_alive()
        assert pool.rows("future-a") == []
        hostile.redis.hdel(hostile.keys.job("future-a"), "status", "unread", "unread_log")
        hostile.redis.hdel(hostile.keys.job("future-a"), "submitted", "result")
        handle = honest.submit("hello", params, request_id="future-a")
        assert handle.enqueued
        output = handle.result(timeout=30)
        want = [bench.token_of("future-a", k) for k in range(12)]
        assert output.error is None and output.outputs[0].token_ids == want
        (row,) = pool.rows("future-a")
        assert row["token_ids"] == want and row["text"] == output.outputs[0].text
        assert FORGED not in row["text"] and row["error"] is None
        # a future id whose marker names an entry that is gone: a never-ran row, with no
        # output text; the genuine submission is refused (the id is taken): no conflict
        forge_ended(hostile, "future-b", "1-1")
        taken(pool)
        (row,) = pool.rows("future-b")
        assert row["text"] == "" and row["token_ids"] == [] and row["finish_reason"] == "error"
        assert "never run" in row["error"]
        late = honest.submit("hello", params, request_id="future-b")
        assert not late.enqueued
        assert late.result(timeout=10).outputs[0].text == ""
        time.sleep(2)
        assert len(pool.rows("future-b")) == 1
        assert list_conflicts(pool.target.engine) == []
        pool.check_alive()
    finally:
        hostile.redis.close()
        honest.redis.close()


def test_row_b_a_running_job_marked_finished_by_another_tenant_is_audited(pool):
    hostile = Producer(pool.url("producer"))
    honest = Producer(pool.url("gateway"))
    rid, count = "victim", 400
    try:
        handle = honest.submit(
            "hello", SamplingParams(max_tokens=count, ignore_eos=True), request_id=rid
        )
        deadline = time.monotonic() + 30
        while pool.admin.llen(pool.keys.out(rid)) < 3:  # running, some chunks out
            assert time.monotonic() < deadline, "the job did not start"
            time.sleep(0.01)
        hostile.redis.hset(pool.keys.job(rid), mapping={"status": "finished", "entry": "1-1"})
        output = handle.result(timeout=60)
        want = [bench.token_of(rid, k) for k in range(count)]
        assert output.error is None and output.outputs[0].token_ids == want
        assert output.outputs[0].finish_reason == "length"
        (row,) = pool.rows(rid)
        assert row["token_ids"] == want and row["text"] == output.outputs[0].text
        assert honest.handle(rid).status() == "finished"
        pool.check_alive()
    finally:
        hostile.redis.close()
        honest.redis.close()
