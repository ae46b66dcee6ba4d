"""Redis faults (issue 14 point 3): a 15 s stall, and SIGKILL + restart with AOF.

Two worker processes and an audit writer process serve 30 jobs on a private
redis-server; in the middle Redis is stopped (SIGSTOP for 15 s) or killed and
restarted on its AOF. Nobody restarts anything by hand: every process must
still be running afterwards, every job must end exactly once (one final
chunk, a gap-free chunk log, one audit row per job) with the tokens of the
same engine run in-process, and ``status`` must drop a killed worker within
its heartbeat TTL. A producer submits two more jobs while Redis is away, and
another waits on every result across the fault. One pool serves all the tests
of this module (each fault's jobs are its own), so the processes start once.

On both pool layouts: a private standalone redis-server, and a private 3-master
Redis Cluster (tests/support/redis_cluster.py) with the pool in 3 shards. There
the fault is one master's, the one that serves the shard of the first job
submitted during the fault (so that submission rides it out as on standalone):
that node alone is stalled, or killed and restarted on its AOF and its
``nodes.conf`` (its slots, their data); the other masters go on serving the
other shards. All nodes stopped at once would be the standalone fault again; one
is what a cluster adds (a shard away while the pool goes on with the others).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from engine_runs import engine_tokens
from pool_layout import pending
from redis_cluster import private_redis
from sqlalchemy import create_engine, text

from lorapool.cli.queue_status import live_workers
from lorapool.connection import connect
from lorapool.lifecycle.chunk_log import log_chunks
from lorapool.lifecycle.keys import Keys
from lorapool.producer import Producer
from lorapool.protocol import SamplingParams
from lorapool.records.chunk import decode_chunk

pytestmark = [pytest.mark.integration, pytest.mark.slow]
PARAMS = SamplingParams(temperature=0.0, max_tokens=96, ignore_eos=True)
PROMPTS = [f"job {i} counts" for i in range(32)]  # the last 2: submitted during the fault
CLI = [sys.executable, "-c", "from lorapool.cli.main import main; main()"]
LAYOUTS = ("standalone", "cluster")


@pytest.fixture(scope="module")
def layout(request):
    """The conftest's ``layout``, module-scoped: pytest then runs every test of one
    layout before the other's, so one private pool runs at a time."""
    if request.param == "cluster" and not os.environ.get("LORAPOOL_TEST_CLUSTER_URL"):
        pytest.skip("no LORAPOOL_TEST_CLUSTER_URL: the cluster layout is not tested here")
    return request.param


@pytest.fixture(scope="module")
def expected(model):
    return engine_tokens(model, PROMPTS, PARAMS, max_num_seqs=30)


class Pool:
    """A private Redis (``private_redis``), 2 worker processes and an audit writer process."""

    def __init__(self, model, server, tmp_path):
        self.server, self.tmp = server, tmp_path
        self.keys = Keys(shards=server.shards)
        pool = ["--redis-url", server.url, "--shards", str(server.shards)]
        self.db = f"sqlite:///{tmp_path / 'audit.db'}"
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        worker = [*CLI, "worker", "--model", model, *pool]
        worker += ["--lease", "3", "--max-num-seqs", "2"]
        self.workers = [self._start(worker, f"worker{i}", env) for i in range(2)]
        writer = [*CLI, "audit-writer", *pool, "--db-url", self.db]
        self.writer = self._start([*writer, "--migrate"], "writer", env)
        self.conn = connect(server.url)
        deadline = time.monotonic() + 120
        while len(live_workers(self.conn, self.keys)) < 2:
            self.check_alive()
            assert time.monotonic() < deadline, "workers did not start"
            time.sleep(0.2)

    def _start(self, cmd, name, env):
        log = open(self.tmp / f"{name}.log", "wb")  # noqa: SIM115 - closed in stop()
        return subprocess.Popen(cmd, cwd=self.tmp, env=env, stdout=log, stderr=log)

    def check_alive(self):
        for name, proc in [("worker0", self.workers[0]), ("worker1", self.workers[1])] + [
            ("writer", self.writer)
        ]:
            if proc.poll() is not None:
                log = (self.tmp / f"{name}.log").read_text()[-4000:]
                raise AssertionError(f"{name} exited with {proc.returncode}:\n{log}")

    def finished(self, producer, handles) -> int:
        count = 0
        for h in handles:
            last = self.conn.lindex(producer.keys.out(h.request_id), -1)
            count += last is not None and decode_chunk(last, h.request_id).finished
        return count

    def stop(self):
        for proc in [*self.workers, self.writer]:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in [*self.workers, self.writer]:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        self.conn.close()


@pytest.fixture(scope="module")
def pool(model, layout, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(f"pool-{layout}")
    with private_redis(layout, tmp / "redis") as server:
        pool = Pool(model, server, tmp)
        yield pool
        pool.stop()


def _check_exactly_once(pool, producer, handles, expected):
    for handle, tokens in zip(handles, expected):
        log = log_chunks(pool.conn, producer.keys, handle.request_id)
        assert [c.seq for c in log] == list(range(len(log)))  # no gap, no duplicate
        assert [c.finished for c in log].count(True) == 1 and log[-1].finished
        assert handle.result(timeout=5).outputs[0].token_ids == tokens
    deadline = time.monotonic() + 60
    db = create_engine(pool.db)
    ids = {h.request_id for h in handles}
    while True:  # the writer drains what the workers audited
        with db.connect() as conn:
            rows = conn.execute(
                text("SELECT request_id, COUNT(*) FROM completions GROUP BY request_id")
            ).all()
        rows = {rid: count for rid, count in rows if rid in ids}
        if len(rows) == len(handles) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert rows == {rid: 1 for rid in ids}
    assert pending(pool.conn, producer.keys) == 0


def _wait_all(handles, results: dict) -> None:
    """A producer waiting on every result across the fault (its reads must ride it out)."""
    try:
        results["outputs"] = [h.result(timeout=240).outputs[0].token_ids for h in handles]
    except Exception as exc:  # noqa: BLE001 - reported by the test
        results["error"] = repr(exc)


def _submit_late(server, fault, handles: list) -> None:
    """Two more jobs submitted while Redis is away (the client's retries carry them)."""
    try:
        ids = [f"{fault}-late-{i}" for i in range(2)]
        producer = Producer(server.url, shards=server.shards)
        handles.extend(producer.submit_many(PROMPTS[30:], PARAMS, request_ids=ids))
    except Exception as exc:  # noqa: BLE001 - reported by the test
        handles.append(repr(exc))


@pytest.mark.parametrize("fault", ["stall_15s", "kill_and_restart"])
def test_pool_rides_out_redis_fault(pool, expected, fault):
    producer = Producer(pool.server.url, shards=pool.server.shards)
    # standalone: the server; a cluster: the master of the first late job's shard
    node = pool.server.node_of(producer.keys.for_request(f"{fault}-late-0").requests)
    ids = [f"{fault}-{i}" for i in range(30)]
    handles = producer.submit_many(PROMPTS[:30], PARAMS, request_ids=ids)
    results, late = {}, []
    waiter = threading.Thread(target=_wait_all, args=(list(handles), results))
    waiter.start()
    deadline = time.monotonic() + 120
    while pool.finished(producer, handles) < 4:  # in the middle: some done, most not
        pool.check_alive()
        assert time.monotonic() < deadline
        time.sleep(0.05)
    submitter = threading.Thread(target=_submit_late, args=(pool.server, fault, late))
    if fault == "stall_15s":
        node.pause()
        submitter.start()
        time.sleep(15)
        node.resume()
    else:
        node.kill()
        submitter.start()
        # past the loops' retries (< 0.6 s), within a producer's (> 3.5 s); a restarted
        # master of a cluster refuses commands for 2 s more (CLUSTERDOWN, Redis's
        # CLUSTER_WRITABLE_DELAY): there it is down 0.8 s, away 2.8 s in all
        time.sleep(2 if pool.server.shards == 0 else 0.8)
        node.start()
    submitter.join(60)
    assert len(late) == 2 and all(h.enqueued for h in late), late  # each queued once
    handles += late
    assert pool.finished(producer, handles) < len(handles)  # the fault hit running jobs
    deadline = time.monotonic() + 180
    while pool.finished(producer, handles) < len(handles):
        pool.check_alive()
        assert time.monotonic() < deadline, "jobs did not complete after the fault"
        time.sleep(0.2)
    pool.check_alive()
    _check_exactly_once(pool, producer, handles, expected)
    waiter.join(30)
    assert results.get("outputs") == expected[:30], results.get("error")
    pool.check_alive()
    if fault == "kill_and_restart":  # longer than redis-py's retries: the loops took over
        for name in ("worker0", "worker1"):
            log = (pool.tmp / f"{name}.log").read_text()
            assert "Redis unreachable" in log and "Redis is back after" in log, log[-3000:]
        assert "retrying in" in (pool.tmp / "writer.log").read_text()


def test_status_drops_a_killed_worker(pool):
    keys = pool.keys
    assert len(live_workers(pool.conn, keys)) == 2
    pool.workers[0].kill()
    pool.workers[0].wait(10)
    killed_at = time.monotonic()
    while len(live_workers(pool.conn, keys)) == 2:
        assert time.monotonic() - killed_at < 5 + 2, "status still lists the killed worker"
        time.sleep(0.2)
    assert len(pool.conn.hkeys(keys.workers)) == 1  # its record was pruned as well
