"""The consumers dead worker processes leave in the ``workers`` groups are deleted
(worker/consumers.py), and no consumer that holds entries ever is.

Real worker processes (the real Worker around the benchmark's stand-in engine,
``standin_worker``) on a private Redis with the users of docs/redis-acl.md, each worker
as the worker's user: what the sweep runs (XINFO CONSUMERS, XGROUP DELCONSUMER in a
script) must be in that user's rules. On both pool layouts: a standalone redis-server,
and a 3-master Redis Cluster with the pool in 3 shards.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from acl_users import role_url, set_users
from redis_cluster import private_redis
from standin import load

from lorapool.cli.queue_status import live_workers
from lorapool.connection import connect
from lorapool.lifecycle.keys import WORKERS_GROUP, Keys
from lorapool.producer import Producer
from lorapool.protocol import SamplingParams
from lorapool.worker.consumers import DEAD_AFTER_LEASES

pytestmark = [pytest.mark.integration, pytest.mark.slow]
LAYOUTS = ("standalone", "cluster")
WORKER = Path(__file__).resolve().parents[1] / "support" / "standin_worker.py"
LEASE_S = 1.0
ALIVE_TTL_S = 5  # WorkerConfig's default
# a dead process's consumer goes once its flag expired and it was quiet for the bound,
# at the next sweep turn (one a lease across the pool); the rest is a loaded box's slack
BOUND_S = ALIVE_TTL_S + DEAD_AFTER_LEASES * LEASE_S + 2 * LEASE_S
SLACK_S = 20
bench = load()


class Pool:
    """Worker processes of one pool on ``server``, their logs in ``tmp``."""

    def __init__(self, server, layout: str, tmp: Path):
        self.tmp, self.procs = tmp, {}
        self.shards = server.shards if layout == "cluster" else 0
        self.keys = Keys("lorapool", self.shards)
        self.admin = connect(server.url)
        self.worker_url = role_url(server, "worker")
        self.producer = Producer(
            role_url(server, "producer"), prefix=self.keys.prefix, shards=self.shards
        )

    def start(self, name: str, sequences: int = 4, step_ms: int = 20) -> None:
        cmd = [sys.executable, str(WORKER), self.worker_url, self.keys.prefix]
        cmd += [str(self.shards), name, str(sequences), str(step_ms), str(LEASE_S)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "LORAPOOL_AUDIT_KEY": bench.AUDIT_KEY}
        log = open(self.tmp / f"{name}.log", "wb")  # noqa: SIM115 - the process keeps it
        self.procs[name] = subprocess.Popen(cmd, env=env, stdout=log, stderr=log)

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text()

    def check_alive(self) -> None:
        for name, proc in self.procs.items():
            if proc.returncode is None and proc.poll() is not None:
                raise AssertionError(f"{name} exited {proc.returncode}:\n{self.log(name)[-3000:]}")

    def wait(self, what: str, until, timeout_s: float) -> float:
        """Seconds it took ``until()`` to hold, checking the workers meanwhile."""
        start = time.monotonic()
        while not until():
            self.check_alive()
            assert time.monotonic() - start < timeout_s, f"timed out waiting for {what}"
            time.sleep(0.1)
        return time.monotonic() - start

    def live(self) -> dict[str, str]:
        """worker name -> its consumer, of the live workers."""
        return {h.name: h.consumer for h in live_workers(self.admin, self.keys)}

    def consumers(self) -> dict[str, int]:
        """consumer -> its pending entries, over every job stream's group."""
        found: dict[str, int] = {}
        for view in self.keys.shard_views:
            for stream in view.streams:
                if not self.admin.exists(stream):
                    continue
                for c in self.admin.xinfo_consumers(stream, WORKERS_GROUP):
                    name = c["name"].decode()
                    found[name] = found.get(name, 0) + c["pending"]
        return found

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        self.producer.redis.close()
        self.admin.close()


@pytest.fixture
def pool(layout, tmp_path):
    with private_redis(layout, tmp_path / "redis") as server:
        set_users(server, layout)
        pool = Pool(server, layout, tmp_path)
        try:
            yield pool
        finally:
            pool.stop()


def _tokens(result) -> list[int]:
    return result.outputs[0].token_ids


def test_killed_workers_consumers_leave_the_group(pool):
    """kill -9 of two of three workers while they hold entries, two others started: the
    entries are claimed and finished, and the group's consumers come back to the live
    ones within the bound; none of the dead is deleted while it holds entries."""
    for name in ("w0", "w1", "w2"):
        pool.start(name)
    pool.wait("three live workers", lambda: len(pool.live()) == 3, 120)
    live = pool.live()
    params = SamplingParams(max_tokens=150, ignore_eos=True)  # 3 s each at 20 ms a step
    handles = []

    def all_hold() -> bool:  # each worker holds entries (a consumer with pending ones)
        handles.extend(pool.producer.submit_many([{"prompt_token_ids": [1]}] * 3, params))
        held = pool.consumers()
        return all(held.get(live[n], 0) > 0 for n in ("w0", "w1"))

    pool.wait("w0 and w1 to hold entries", all_hold, 60)
    dead = {live["w0"], live["w1"]}
    for name in ("w0", "w1"):
        pool.procs[name].kill()
        pool.procs[name].wait()
    pool.start("w3")
    pool.start("w4")
    seen_pending = set()

    def settled() -> bool:
        found = pool.consumers()
        seen_pending.update(n for n in dead if found.get(n, 0) > 0)
        return not dead & set(found)

    took = pool.wait("the dead consumers to go", settled, BOUND_S + SLACK_S)
    assert seen_pending, "the dead held no entry when killed: the test proves nothing"
    assert set(pool.consumers()) <= set(pool.live().values())
    for handle in handles:  # the dead's entries were claimed, not deleted with them
        result = handle.result(timeout=60)
        assert _tokens(result) == [bench.token_of(handle.request_id, i) for i in range(150)]
    print(f"dead consumers gone {took:.1f}s after the kill (bound {BOUND_S:.0f}s)")
    assert len(pool.live()) == 3


@pytest.mark.layouts("standalone")
def test_only_quiet_unflagged_consumers_without_entries_go(pool):
    """Beside a live worker whose one sequence is busy (so it claims nothing): a consumer
    that holds an entry and has no liveness flag stays until the worker claims its
    entry; one without entries but with a flag (a live worker slow to heartbeat) stays;
    one with neither goes. The held entry's job then ends, once, with its tokens."""
    pool.start("busy", sequences=1, step_ms=20)
    pool.wait("the worker", lambda: len(pool.live()) == 1, 120)
    long = pool.producer.submit({"prompt_token_ids": [1]}, SamplingParams(max_tokens=1200))
    stream, admin, keys = pool.keys.requests, pool.admin, pool.keys
    pool.wait("the long job to run", lambda: admin.llen(keys.out(long.request_id)) > 0, 30)
    held = pool.producer.submit({"prompt_token_ids": [2]}, SamplingParams(max_tokens=5))
    assert admin.xreadgroup(WORKERS_GROUP, "ghost#dead", {stream: ">"}, count=1)
    admin.xgroup_createconsumer(stream, WORKERS_GROUP, "quiet#dead")
    admin.xgroup_createconsumer(stream, WORKERS_GROUP, "slow#alive")
    admin.set(keys.alive("slow#alive"), 1, ex=120)
    took = pool.wait("quiet#dead to go", lambda: "quiet#dead" not in pool.consumers(), 60)
    assert took >= DEAD_AFTER_LEASES * LEASE_S - 0.5  # not before the bound
    time.sleep(2 * LEASE_S)  # two more sweep turns
    assert admin.llen(keys.out(held.request_id)) == 0, "the busy worker took it: no proof"
    assert pool.consumers() == {pool.live()["busy"]: 1, "ghost#dead": 1, "slow#alive": 0}
    result = held.result(timeout=120)  # claimed once the long job ends, then ghost goes
    assert _tokens(result) == [bench.token_of(held.request_id, i) for i in range(5)]
    pool.wait("ghost#dead to go", lambda: "ghost#dead" not in pool.consumers(), 30)
    assert "slow#alive" in pool.consumers()
    assert "consumers of dead processes deleted from" in pool.log("busy")
    assert "quiet#dead" in pool.log("busy") and "slow#alive" not in pool.log("busy")


@pytest.mark.layouts("standalone")
def test_a_worker_frozen_past_the_bound_serves_on_without_its_consumer(pool):
    """A live worker frozen (SIGSTOP) with entries, past its liveness flag and the bound:
    the other claims its entries, then its consumer goes. Woken, it appends nothing for
    what it lost, exits on nothing, and its next read makes its consumer again, under
    which it serves new jobs: every job of either round ends with its tokens."""
    pool.start("a")
    pool.start("b")
    pool.wait("two live workers", lambda: len(pool.live()) == 2, 120)
    frozen = pool.live()["a"]
    params = SamplingParams(max_tokens=150, ignore_eos=True)
    handles = []

    def holds() -> bool:
        handles.extend(pool.producer.submit_many([{"prompt_token_ids": [1]}] * 2, params))
        return pool.consumers().get(frozen, 0) > 0

    pool.wait("a to hold entries", holds, 60)
    pool.procs["a"].send_signal(signal.SIGSTOP)
    pool.wait("a's consumer to go", lambda: frozen not in pool.consumers(), BOUND_S + SLACK_S)
    pool.procs["a"].send_signal(signal.SIGCONT)
    pool.wait("a's heartbeat", lambda: frozen in pool.live().values(), 30)

    def serves() -> bool:
        handles.extend(pool.producer.submit_many([{"prompt_token_ids": [2]}] * 2, params))
        return pool.consumers().get(frozen, 0) > 0

    pool.wait("a to hold new entries", serves, 60)
    for handle in handles:
        result = handle.result(timeout=120)
        assert _tokens(result) == [bench.token_of(handle.request_id, i) for i in range(150)]
    pool.check_alive()
    woken = pool.log("a")  # what it held: taken over, or finished by then (acked)
    assert "to another worker" in woken or "had finished, or is forgotten" in woken, woken


@pytest.mark.layouts("standalone")
def test_a_worker_without_the_rights_says_so_once_and_serves(pool):
    """The worker's user of an older docs/redis-acl.md (no +xinfo|consumers, no
    +xgroup|delconsumer): the worker logs once what it lacks and serves on."""
    pool.admin.execute_command("ACL", "SETUSER", "lorapool-worker", "-xinfo|consumers")
    pool.admin.execute_command("ACL", "SETUSER", "lorapool-worker", "-xgroup|delconsumer")
    pool.start("old")
    pool.wait("the worker", lambda: len(pool.live()) == 1, 120)
    stream = pool.keys.requests
    pool.admin.xgroup_createconsumer(stream, WORKERS_GROUP, "quiet#dead")
    time.sleep(DEAD_AFTER_LEASES * LEASE_S + 3 * LEASE_S)
    handle = pool.producer.submit({"prompt_token_ids": [1]}, SamplingParams(max_tokens=4))
    assert _tokens(handle.result(timeout=60)) == [
        bench.token_of(handle.request_id, i) for i in range(4)
    ]
    assert "quiet#dead" in pool.consumers()
    assert pool.log("old").count("the consumers of dead processes stay") == 1, pool.log("old")
