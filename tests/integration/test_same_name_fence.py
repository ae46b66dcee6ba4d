"""Fencing by incarnation, not by name (issue 48 row C).

Two worker processes started with one ``--name`` (a supervisor restarting ``gpu0``,
a StatefulSet pod after a partition): the first is frozen (SIGSTOP) past its lease
with 16 long greedy jobs half written, the second takes them over and resumes them
from their chunk logs, then the first wakes. Each process is its own consumer in the
group (``name#incarnation``), so the woken one appends nothing more, and says why in
its log. Every job's log is gap-free with one final chunk, its tokens (what a client
reading the log gets) are the in-process engine's, and its audit row holds the same.
Real processes on a private redis-server, so the timing is the test's.

The first worker writes every step's tokens as a chunk and the second coalesces
several steps into one (``--max-chunk-rate``), as load makes two workers' chunks
differ in a pool: a chunk's seq then stands for other tokens in each, so a fence
that cannot tell the two apart (the shared consumer name, before) shows as tokens at
wrong offsets, and not only when the timing happens to split them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from engine_runs import engine_tokens
from redis_cluster import private_redis
from sqlalchemy import create_engine

from lorapool.audit_db.queries import get_request
from lorapool.cli.queue_status import live_workers
from lorapool.connection import connect
from lorapool.lifecycle.chunk_log import log_chunks
from lorapool.lifecycle.keys import Keys
from lorapool.producer import Producer
from lorapool.protocol import SamplingParams
from lorapool.records.heartbeat import Heartbeat, encode_heartbeat
from lorapool.worker.pool import same_name_alive

pytestmark = [pytest.mark.integration, pytest.mark.slow]
PARAMS = SamplingParams(temperature=0.0, max_tokens=320, ignore_eos=True)
PROMPTS = [f"job {i} of the same-name pool counts" for i in range(16)]
CLI = [sys.executable, "-c", "from lorapool.cli.main import main; main()"]


@pytest.fixture(scope="module")
def expected(model):
    return engine_tokens(model, PROMPTS, PARAMS, max_num_seqs=16)


class Processes:
    """Worker and audit-writer processes on one private Redis, their logs in ``tmp``."""

    def __init__(self, model, server, tmp):
        self.tmp, self.procs = tmp, {}
        self.pool = ["--redis-url", server.url]
        self.worker = [*CLI, "worker", "--model", model, *self.pool, "--name", "gpu0"]
        self.worker += ["--lease", "2", "--max-num-seqs", "16"]
        self.env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def start(self, name, cmd):
        log = open(self.tmp / f"{name}.log", "wb")  # noqa: SIM115 - the process keeps it
        self.procs[name] = subprocess.Popen(cmd, cwd=self.tmp, env=self.env, stdout=log, stderr=log)

    def log(self, name) -> str:
        return (self.tmp / f"{name}.log").read_text()

    def check_alive(self):
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                raise AssertionError(f"{name} exited {proc.returncode}:\n{self.log(name)[-4000:]}")

    def stop(self):
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


def _wait(what, until, procs, timeout_s):
    deadline = time.monotonic() + timeout_s
    while not until():
        procs.check_alive()
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_same_name_worker_woken_past_its_lease_appends_nothing(model, expected, tmp_path):
    with private_redis("standalone", tmp_path / "redis") as server:
        procs = Processes(model, server, tmp_path)
        try:
            _run(procs, server, expected)
        finally:
            procs.stop()


def _run(procs, server, expected):
    db = f"sqlite:///{procs.tmp / 'audit.db'}"
    conn, keys = connect(server.url), Keys()
    procs.start("writer", [*CLI, "audit-writer", *procs.pool, "--db-url", db, "--migrate"])
    procs.start("a", [*procs.worker, "--max-chunk-rate", "0"])
    _wait("worker a", lambda: len(live_workers(conn, keys)) == 1, procs, 120)
    producer = Producer(server.url)
    handles = producer.submit_many(PROMPTS, PARAMS)
    logs = [keys.out(h.request_id) for h in handles]
    lengths = lambda: [conn.llen(k) for k in logs]  # noqa: E731
    _wait("a's first chunks", lambda: min(lengths()) >= 3, procs, 60)
    procs.procs["a"].send_signal(signal.SIGSTOP)  # frozen mid-stream, past its lease
    stopped = lengths()
    procs.start("b", [*procs.worker, "--max-chunk-rate", "40"])  # the same --name
    # b claims after the lease and resumes from the logs; a wakes while b writes them
    grown = lambda: all(n >= s + 3 for n, s in zip(lengths(), stopped))  # noqa: E731
    _wait("b's chunks", grown, procs, 90)
    procs.procs["a"].send_signal(signal.SIGCONT)
    finished = lambda: all(log_chunks(conn, keys, h.request_id)[-1].finished for h in handles)  # noqa: E731
    _wait("every final chunk", finished, procs, 120)
    audit = create_engine(db)
    for handle, tokens in zip(handles, expected):
        _check_log(conn, keys, handle.request_id, tokens)
        assert handle.result(timeout=5).outputs[0].token_ids == tokens
        rows = _rows(audit, handle.request_id, procs)
        assert [row["token_ids"] for row in rows] == [tokens]
    a_log = procs.log("a")
    assert "lost" in a_log and "to another worker" in a_log, a_log[-4000:]
    conn.close()


def _check_log(conn, keys, rid, tokens):
    """One final chunk, no gap, each chunk at the offset of the tokens before it, and
    the tokens a reader of the log gets are ``tokens``."""
    log = log_chunks(conn, keys, rid)
    assert [c.seq for c in log] == list(range(len(log)))
    assert [c.finished for c in log].count(True) == 1 and log[-1].finished
    got = []
    for chunk in log:
        assert chunk.error is None, chunk.error
        for delta in chunk.outputs:
            assert chunk.offset_of(delta) == len(got), (rid, chunk.seq)
            got += delta.token_ids
    assert got == tokens


def _rows(audit, rid, procs, timeout_s=30):
    """The request's audit rows, once the writer has committed them."""
    deadline = time.monotonic() + timeout_s
    while not (rows := get_request(audit, rid)) and time.monotonic() < deadline:
        procs.check_alive()
        time.sleep(0.2)
    return rows


def test_the_live_processes_sharing_a_name_are_found_by_their_consumers(conn, keys):
    """What a worker's start names in its warning: the other live consumers of its
    name, an older worker's (its consumer was its name) among them; not a stopped one's
    (its alive flag expired), not another name's, not its own."""
    mine, twin, stopped, old = "gpu0#0000aaaa", "gpu0#1111bbbb", "gpu0#2222cccc", "gpu0"
    records = {c: Heartbeat(name="gpu0", consumer=c) for c in (mine, twin, stopped)}
    records[old] = Heartbeat(name="gpu0")
    records["gpu1#3333dddd"] = Heartbeat(name="gpu1", consumer="gpu1#3333dddd")
    conn.hset(keys.workers, mapping={c: encode_heartbeat(h) for c, h in records.items()})
    for consumer in (mine, twin, old, "gpu1#3333dddd"):
        conn.set(keys.alive(consumer), 1, ex=30)
    assert same_name_alive(conn, keys, "gpu0", mine) == [old, twin]
