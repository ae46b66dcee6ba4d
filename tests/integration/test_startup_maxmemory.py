"""Issue 48 F: a worker and an audit writer started while Redis is at maxmemory wait.

Redis at ``maxmemory`` under ``noeviction`` refuses every write; the two processes
used to exit on their first one (the worker claiming the pool, the writer creating
its consumer group) with an OutOfMemoryError traceback. Started as the CLI starts
them, on a private redis-server whose maxmemory every write exceeds, each now logs
why it waits and stays up; once an operator raises maxmemory the worker serves a job
and the writer stores its audit row, with nobody restarting anything.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time

import pytest
import redis
from redis_server import RedisServer

from lorapool.cli.queue_status import live_workers
from lorapool.connection import connect
from lorapool.lifecycle.keys import Keys
from lorapool.producer import Producer
from lorapool.protocol import SamplingParams

pytestmark = pytest.mark.integration
CLI = [sys.executable, "-c", "from lorapool.cli.main import main; main()"]


def _wait_for(what: str, ok, procs, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        for name, proc, log in procs:
            assert proc.poll() is None, f"{name} exited:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def test_a_worker_and_an_audit_writer_started_at_maxmemory_wait_then_serve(model, tmp_path):
    server = RedisServer(tmp_path / "redis").start()
    admin = server.client()
    procs = []
    try:
        admin.config_set("maxmemory-policy", "noeviction")
        admin.config_set("maxmemory", 1)  # below what Redis uses: every write is refused
        with pytest.raises(redis.OutOfMemoryError):
            admin.set("probe", "1")
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        db = tmp_path / "audit.db"
        commands = {
            "worker": [*CLI, "worker", "--model", model, "--redis-url", server.url],
            "writer": [*CLI, "audit-writer", "--redis-url", server.url, "--migrate"]
            + ["--db-url", f"sqlite:///{db}"],
        }
        for name, command in commands.items():
            log = tmp_path / f"{name}.log"
            with open(log, "wb") as out:
                proc = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=out, stderr=out)
            procs.append((name, proc, log))
        for name, _, log in procs:
            said = log.read_bytes
            _wait_for(f"{name} to say why it waits", lambda s=said: b"out of memory" in s(), procs)
        time.sleep(3)  # a few more tries: still up, no traceback
        for _, proc, log in procs:
            assert proc.poll() is None, log.read_text()[-3000:]
            assert b"Traceback" not in log.read_bytes(), log.read_text()[-3000:]
        worker_log = procs[0][2].read_text()
        assert "cannot claim the pool: Redis is out of memory" in worker_log

        admin.config_set("maxmemory", 0)  # the operator makes room
        conn = connect(server.url)
        _wait_for("the worker to serve", lambda: len(live_workers(conn, Keys())) == 1, procs)
        job = Producer(conn).submit("a job after the wait", SamplingParams(max_tokens=3))
        assert job.result(timeout=60).finished

        def stored() -> bool:
            if not db.exists():
                return False
            with sqlite3.connect(db) as sql:
                try:
                    rows = sql.execute("SELECT request_id FROM completions").fetchall()
                except sqlite3.OperationalError:  # the writer's schema not there yet
                    return False
            return rows == [(job.request_id,)]

        _wait_for("the writer to store the job's row", stored, procs)
        assert "could claim the pool after" in procs[0][2].read_text()
        assert "could create the consumer group again after" in procs[1][2].read_text()
        conn.close()
    finally:
        for _, proc, _ in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for _, proc, _ in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        admin.close()
        server.stop()
