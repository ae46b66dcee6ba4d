"""A stateful property test of queue integrity (issue 31, Acceptance): hypothesis drives
a pool of 2 workers (the real Worker loop around the stand-in engine, on a private
redis-server) with producers, duplicate XADDs, aborts and an operator's actions: XTRIM,
XDEL, a group destroyed and re-created, DEL of a marker or a log, SET of a wrong type
on a key a producer may write; worker SIGKILL and SIGSTOP; Redis restarts with and
without AOF.

Workers are in-process, stepped by the test. A SIGKILL or SIGSTOP is made where Redis
could see one land (tests/support/worker_faults.py): at a drawn send of the worker's
or its sender's thread, before the send or after it and before its reply is read (the
command ran, its result never applied): so also between an engine step and the APPEND
of its tokens, and in the sender mid-trip. A killed worker never tears down; its
entries return after the lease and a replacement with a new name joins. A stopped one
is held there past its lease while the other claims what it held, then goes on: it must
not run, append or audit anything twice. The same faults on real worker processes
(``lorapool worker``, kill -9 and SIGSTOP past the lease) are in
test_queue_processes.py (test_kill_9_worker_loses_nothing,
test_sigstop_past_lease_is_fenced), and Redis stalls and restarts under worker
processes in test_redis_faults.py and test_queue_integrity.py. A Redis restart is a
SIGKILL of the server and a start: with AOF (``appendfsync always``) on what it
acknowledged, so nothing is lost; without persistence its files are removed first
(what a server that keeps none comes back as: empty).

Invariant after every run: every submitted id ends exactly once, with a final chunk (ok
or a named error) that its reader receives, or JobLost, allowed only for ids whose
marker or log an operator deleted or that a restart without persistence lost; at most
one audit record per id (in the audit stream: one a lossy restart wiped is not seen; an
id whose marker and log were both gone at once is new to Redis, and a duplicate entry
runs it again); no worker stops or raises; nothing pending, nothing unread. An entry an
operator removed (XTRIM, XDEL, a group re-created at '$') while no live worker held it
(before any read, held by a killed worker whose lease no one had taken over yet, or
removed under a worker killed before it noticed) is never run, or never resumed: its
reader gets a final error chunk when its marker still names its entry, after what a
killed worker wrote of it if anything (lifecycle/unread.py, lifecycle/orphaned.py); an
id with no such marker (a raw XADD's, one deleted, of another type or whose entry a
producer removed) is left out (nothing can tell it will not run: its reader waits
until its timeout, a known gap). A hostile producer
(the doc's producer ACL user: tests/support/hostile_producer.py, issue 48) forges markers,
pushes ids, raw jobs and submits on any id: every audit record holds what a worker made
for its id or no output; every job it did not take first keeps its final and its row.
CI: bounded; ``--hypothesis-profile=long`` or ``LORAPOOL_STATEFUL_S=1800`` (30 min).
"""

from __future__ import annotations

import os
import re
import shutil
import threading
import time
import uuid

import pytest
from hostile_producer import HostileProducer
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from redis_server import RedisServer
from standin import load
from worker_faults import Killed, Switch, switched_client
from worker_loop import looping

from lorapool.connection import connect
from lorapool.lifecycle import orphaned
from lorapool.lifecycle.chunk_log import log_chunks
from lorapool.lifecycle.keys import WORKERS_GROUP, Keys
from lorapool.lifecycle.submit import build_job
from lorapool.producer import JobLost, Producer
from lorapool.producer.client import JobHandle
from lorapool.protocol import SamplingParams
from lorapool.records.job import encode_job
from lorapool.worker import Worker, WorkerConfig

pytestmark = pytest.mark.integration
bench = load()
LEASE_S = 1
STOP_S = 2.0  # a SIGSTOP outlasts the lease and the other's next claim (every LEASE_S / 2)


@pytest.fixture
def server(layout, tmp_path):
    """A private redis-server (AOF, appendfsync always) that the test may kill."""
    if layout != "standalone":
        pytest.skip("standalone only")
    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.stop()


def wipe(directory) -> None:
    """A stopped server's data files removed: it starts as one without persistence does."""
    for path in directory.iterdir():
        if path.name != "redis.log":
            shutil.rmtree(path) if path.is_dir() else path.unlink()


def request_id(fields: dict) -> str:
    """The request id in a job or audit entry's JSON (read without decoding it whole)."""
    return fields[b"data"].split(b'"request_id":"', 1)[-1].split(b'"', 1)[0].decode()


def test_queue_integrity_stateful(server):
    conn = connect(server.url)

    class Pool(HostileProducer, RuleBasedStateMachine):
        @initialize()
        def start(self):
            self.keys, self.conn = Keys(f"test-sm-{uuid.uuid4().hex[:8]}"), conn
            self.producer = Producer(conn, prefix=self.keys.prefix)
            self.producer_user()
            self.hostile = connect(server.url.replace("://", "://lorapool-producer:pw@", 1))
            self.switches: dict[str, Switch] = {}
            self.workers = [self._worker(), self._worker()]
            self.submitted: dict[str, SamplingParams] = {}
            self.removed: set[str] = set()  # entries removed while no live worker held them
            self.dead: set[str] = set()  # the consumers of killed workers
            self.may_lose: set[str] = set()  # ids whose marker or log may be gone
            self.deleted: set[str] = set()  # ids whose marker or log an operator deleted
            self.forgotten: set[str] = set()  # ids whose marker and log were both gone
            self.count = 0
            for tokens in (8, 40, 90):  # some work from the start, short and long
                self.submit(tokens)

        def _worker(self) -> Worker:
            """A worker of the pool with a name of its own (a replacement's is new)."""
            name = f"w{len(self.switches) + 1}"
            switch = self.switches[name] = Switch()
            config = WorkerConfig(
                prefix=self.keys.prefix,
                name=name,
                audit_key=bench.AUDIT_KEY.encode(),
                lease_s=LEASE_S,
                block_ms=10,
            )
            client = switched_client(server.url, switch)
            worker = Worker(bench.StandInEngine(8, 0.001), client, config, bench.BASE_MODEL)
            worker.ensure_group()
            return worker

        def _ids(self):
            return sorted(self.submitted)

        @rule(tokens=st.integers(2, 90))
        def submit(self, tokens):
            rid = f"r{self.count}"
            self.count += 1
            params = SamplingParams(max_tokens=tokens, ignore_eos=True)
            handle = self.producer.submit({"prompt_token_ids": [1, 2]}, params, request_id=rid)
            if handle.enqueued:  # else the hostile producer took the id first
                self.submitted[rid] = params

        @rule(data=st.data())
        def duplicate(self, data):
            if self.submitted:
                rid = data.draw(st.sampled_from(self._ids()))
                job = build_job({"prompt_token_ids": [1, 2]}, self.submitted[rid], None, rid, None)
                conn.xadd(self.keys.requests, {"data": encode_job(job)})

        @rule(data=st.data())
        def abort(self, data):
            if self.submitted:
                self.producer.abort(data.draw(st.sampled_from(self._ids())))

        @rule(steps=st.integers(1, 30))
        def run(self, steps):
            for _ in range(steps):
                for worker in self.workers:
                    worker.run_guarded()

        def _group(self) -> dict | None:
            if not conn.exists(self.keys.requests):
                return None
            groups = {g["name"]: g for g in conn.xinfo_groups(self.keys.requests)}
            return groups.get(WORKERS_GROUP.encode())

        def _unread(self) -> set[str]:
            """The ids of entries no worker has read yet (removed, they never run)."""
            group = self._group()
            last = group["last-delivered-id"].decode() if group else "0-0"
            ids = set()
            for _, fields in conn.xrange(self.keys.requests, f"({last}", "+"):
                ids.add(request_id(fields))
            return ids

        def _gone(self, worker: Worker) -> set[str]:
            """The ids a killed ``worker`` held whose entries were removed under it before
            it noticed (or finished, the reply lost): no one will notice now."""
            pending = set()
            if self._group() is not None:
                infos = conn.xpending_range(self.keys.requests, WORKERS_GROUP, "-", "+", 1000)
                pending = {p["message_id"].decode() for p in infos}
            return {
                rid
                for rid, held in worker.held.items()
                if held.entry_id not in pending
                or not conn.xrange(self.keys.requests, held.entry_id, held.entry_id)
            }

        def _orphans(self, entries: set[bytes] | None = None) -> set[str]:
            """The ids of entries (of ``entries``; None: all) pending to a killed worker:
            no one holds them until another claims them after the lease."""
            if self._group() is None:
                return set()
            pending = conn.xpending_range(self.keys.requests, WORKERS_GROUP, "-", "+", 1000)
            ids = set()
            for p in pending:
                entry = p["message_id"]
                if p["consumer"].decode() in self.dead and (entries is None or entry in entries):
                    found = conn.xrange(self.keys.requests, entry, entry)
                    ids.update(request_id(fields) for _, fields in found)
            return ids

        @rule()
        def xtrim(self):
            self.removed |= (self._unread() - self._read_elsewhere()) | self._orphans()
            conn.xtrim(self.keys.requests, maxlen=0)

        @rule(pick=st.integers(0, 49))
        def xdel(self, pick):
            """XDEL of a pending entry (picked by position: what is pending depends on
            timing, and hypothesis needs the same draws for the same choices)."""
            if self._group() is None:
                return
            pending = conn.xpending_range(self.keys.requests, WORKERS_GROUP, "-", "+", 50)
            if pending:
                entry = pending[pick % len(pending)]["message_id"]
                self.removed |= self._orphans({entry})
                conn.xdel(self.keys.requests, entry)

        @rule()
        def group_reset(self):
            if self._group() is None:
                return
            self.removed |= (self._unread() - self._read_elsewhere()) | self._orphans()
            conn.xgroup_destroy(self.keys.requests, WORKERS_GROUP)
            conn.xgroup_create(self.keys.requests, WORKERS_GROUP, id="$")

        def _read_elsewhere(self) -> set[str]:
            """Ids with another entry that a worker read (a duplicate's twin)."""
            return {rid for rid in self.submitted if conn.exists(self.keys.out(rid))}

        @rule(data=st.data(), what=st.sampled_from(["job", "out"]))
        def delete(self, data, what):
            if self.submitted:
                rid = data.draw(st.sampled_from(self._ids()))
                conn.delete(getattr(self.keys, what)(rid))
                self.may_lose.add(rid), self.deleted.add(rid)
                if not conn.exists(self.keys.job(rid), self.keys.out(rid)):
                    self.forgotten.add(rid)  # to Redis a new id: a duplicate runs it again

        @rule(data=st.data(), what=st.sampled_from(["job", "abort"]))
        def wrong_type(self, data, what):
            if self.submitted:
                rid = data.draw(st.sampled_from(self._ids()))
                key = getattr(self.keys, what)(rid)
                conn.delete(key)
                conn.rpush(key, "x") if what == "job" else conn.hset(key, "x", 1)

        @rule(which=st.integers(0, 1), after=st.integers(0, 12), reply=st.booleans())
        def sigkill(self, which, after, reply):
            """A worker killed at a send (worker_faults); a new one takes its place."""
            worker = self.workers[which]
            self.switches[worker.name].arm("kill", after, reply)
            try:
                for _ in range(100):  # an idle iteration sends at least its read
                    worker.run_guarded()
            except Killed:
                pass
            self.switches[worker.name].arm("kill", 0, False)  # dead from here on anyway
            self.dead.add(worker.consumer)
            self.removed |= self._gone(worker)
            worker.publisher.close()  # its sender's thread: a trip of it gets Killed
            worker.redis.close()
            self.workers[which] = self._worker()

        @rule(which=st.integers(0, 1), after=st.integers(0, 12), reply=st.booleans())
        def sigstop(self, which, after, reply):
            """A worker stopped at a send for longer than its lease while the other goes
            on, then continued (SIGCONT)."""
            worker, other = self.workers[which], self.workers[1 - which]
            switch, failed, over = self.switches[worker.name], [], threading.Event()

            def stepped():
                try:  # until a send of its holds it, then on; never past this rule (a
                    # thread left looping here outlived its test: the worker retried its
                    # stopped Redis for ever and the interpreter waited for it at exit)
                    while not switch.fired and not over.is_set():
                        worker.run_guarded()
                except BaseException as exc:  # noqa: BLE001 - raised on the test's thread
                    failed.append(exc)

            switch.arm("stop", after, reply)
            name = f"stopped-{worker.name}"
            thread = threading.Thread(target=stepped, name=name, daemon=True)
            thread.start()
            try:
                assert switch.wait_stopped(10), f"{worker.name} never got to a send"
                until = time.monotonic() + STOP_S
                while time.monotonic() < until:
                    other.run_guarded()
            finally:
                switch.resume()
                over.set()
                thread.join(30)
            assert not thread.is_alive(), f"{worker.name} still in an iteration 30 s on"
            assert not failed, failed

        @rule(aof=st.booleans())
        def redis_restart(self, aof):
            """Redis killed and started: on its AOF, or empty (no persistence)."""
            server.kill()
            if not aof:
                wipe(server.directory)
                self.may_lose |= set(self.submitted)
                self.forgotten |= set(self.submitted)
            server.start()
            self.producer_user()  # ACL SETUSER is not persisted

        @invariant()
        def workers_run(self):
            for worker in getattr(self, "workers", []):
                assert not worker.stopped

        def teardown(self):
            try:
                self._settle()
                self._check()
            finally:
                for worker in self.workers:
                    worker.teardown()
                    worker.redis.close()
                self.hostile.close(), conn.flushall()

        def _settle(self):
            deadline = time.monotonic() + 30
            while True:
                for worker in self.workers:
                    worker.run_guarded()
                    assert not worker.stopped
                busy = any(w.held or w.engine.has_unfinished_requests() for w in self.workers)
                group = self._group()
                # nothing unread: no entry past the last delivered (XINFO's lag counts the
                # entries an XTRIM took unread as waiting, for ever)
                if not busy and group and group["pending"] == 0 and not self._unread():
                    return
                assert time.monotonic() < deadline, f"not settled: {group}, {busy=}"

        def _check(self):
            with looping(self.workers[0]):  # readers ask, a live worker ends (issue 48)
                for rid in self._ids():
                    out_type = conn.type(self.keys.out(rid))
                    chunks = log_chunks(conn, self.keys, rid) if out_type == b"list" else []
                    assert [c.finished for c in chunks].count(True) <= 1, rid
                    self._check_reader(rid, out_type)
            lossy = self.deleted | self.forgotten
            audits = self.check_audit_outputs(bench.AUDIT_KEY.encode(), lossy)
            twice = {rid: n for rid, n in audits.items() if n > 1 and rid not in self.forgotten}
            assert not twice, twice
            kept = set(self.submitted) - self.may_lose - self.removed - self.forgotten
            assert not {rid for rid in kept if rid not in audits}, "a final's row suppressed"

        def _check_reader(self, rid: str, out_type: bytes) -> None:
            """The reader of ``rid`` gets its final output, or JobLost if it may be lost."""
            marker = conn.type(self.keys.job(rid))
            entry = conn.hget(self.keys.job(rid), "entry") if marker == b"hash" else None
            if rid in self.removed and not re.fullmatch(rb"\d+-\d+", entry or b""):
                return  # removed, and no marker names an entry to end it by (a known gap)
            if rid in self.may_lose and marker not in (b"hash", b"none"):
                head = log_chunks(conn, self.keys, rid)[:1] if out_type == b"list" else []
                if not head or head[0].seq > 0:
                    return  # its log (or its head) lost, and no marker to hold the output
            handle = (
                self.producer.handle(rid) if marker == b"hash" else JobHandle(self.producer, rid)
            )
            try:
                # a run a killed worker began ends after its log was quiet QUIET_S
                output = handle.result(timeout=5 + orphaned.QUIET_S)
            except JobLost:
                assert rid in self.may_lose, f"{rid}: JobLost, nothing removed it"
                return
            except TimeoutError:  # lost, and a marker the hostile producer wrote hides it
                assert rid in self.may_lose and rid in getattr(self, "touched", ()), rid
                return
            assert output.finished

    at_length = settings.default.max_examples >= 1000  # --hypothesis-profile=long
    Pool.TestCase.settings = settings(
        max_examples=settings.default.max_examples if at_length else 5,
        stateful_step_count=12,
        deadline=None,
        phases=[Phase.explicit, Phase.reuse, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    until = time.monotonic() + float(os.environ.get("LORAPOOL_STATEFUL_S", "0"))
    try:
        Pool.TestCase().runTest()
        while time.monotonic() < until:  # on demand: runs of new examples until then
            Pool.TestCase().runTest()
    finally:
        conn.close()
