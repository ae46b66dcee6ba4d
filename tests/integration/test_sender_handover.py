"""The hand-over between the worker's thread and its sender's (``worker/publisher.py``,
``worker/sender.py``), checked under stress on the real Redis.

The rule: a request's ``Held`` (its kept chunks) is the sender's from the moment a
trip carrying it is handed over (``Sender.hand``) until the worker's thread takes
that trip back (``Sender.take_done``), and the worker's thread takes every trip
back before it hands the next. A checker follows the hand-overs and every access
to a ``Held``'s kept chunks (a descriptor on ``Held.kept``): the sender's thread
touching a Held no trip handed it, the worker's thread touching one that is out,
or a trip handed while another is out, is a violation. Python has no thread
sanitizer; this is its ownership check, with the interpreter switching threads
every microsecond (``sys.setswitchinterval``) and the worker's thread pausing
0.2 ms at half its looks at ``Sender.idle``, so that trips end between its looks
(without the pause the race below was hit in none of 3 runs).

Both threads hammer: a stand-in engine stepping without pause, a trip per step
(``max_chunk_rate=0``), ~900 trips; the worker's thread also touches every
Held's kept chunks after each third ``flush(wait=True)`` (as ``_fail_step`` and
``fail_all_vanished`` do), and some requests' chunk logs are unwritable, so that
trips come back with ``BAD_LOG`` and the worker's thread fails those requests
(``fail_unwritable``, which writes their kept chunks) while taking trips back.

How its power was checked (by hand, 2026-11-26): on the publisher before this
test (main d5b3bd8) it failed 3 of 3 runs, ~600 violations each (a trip that
ended between ``flush``'s ``_collect`` and its look at ``idle`` was taken back
only after the next was handed, and ``flush(wait=True)`` could return with it
not taken back): the race this hand-over closed. With ``flush(wait=True)`` no
longer waiting at its end: 3 of 3 failed (worker touched Helds while out). With
``flush``'s second ``_collect`` and ``Sender.hand``'s guard both removed: 3 of 3
failed (a trip handed while another was out); with the guard kept, the worker
raised its RuntimeError (2 of 2). As landed: 5 of 5 passed, in about 1 s each.
"""

import random
import sys
import threading
import time
from collections import Counter

import pytest
from pool_layout import length
from standin import load

from lorapool.protocol import SamplingParams
from lorapool.worker import Worker, WorkerConfig
from lorapool.worker.held import Held
from lorapool.worker.sender import Sender

pytestmark = pytest.mark.integration
PROMPT = {"prompt_token_ids": [1, 2, 3]}
JOBS, TOKENS, SEQS = 240, 24, 6  # ~1,000 steps, a trip each


class Ownership:
    """Which Helds are out on a trip, and every access that breaks the hand-over."""

    def __init__(self):
        self.out: Counter = Counter()  # id(held) -> trips out that carry it
        self.trips: set[int] = set()  # the trips the worker's thread handed, not taken back
        self.lock = threading.Lock()
        self.violations: list[str] = []
        self.touches = Counter()  # thread kind -> accesses checked

    def handed(self, trip) -> None:
        with self.lock:
            if self.trips:
                self.violations.append("a trip handed while another was out")
            self.trips.add(id(trip))
            for held, _, _ in getattr(trip, "outputs", ()):
                self.out[id(held)] += 1

    def taken(self, done) -> None:
        with self.lock:
            for trip, _ in done:  # (the sender's own lease renewals carry no Held)
                self.trips.discard(id(trip))
                for held, _, _ in getattr(trip, "outputs", ()):
                    self.out[id(held)] -= 1

    def touch(self, held) -> None:
        sender = threading.current_thread().name.startswith("sender-")
        with self.lock:
            out = self.out[id(held)] > 0
            self.touches["sender" if sender else "worker"] += 1
            if sender and not out:
                self.violations.append(f"sender touched {held.request_id}, not handed to it")
            if not sender and out:
                self.violations.append(f"worker touched {held.request_id} while out")


class CheckedKept:
    """``Held.kept`` as a data descriptor: each read is an access the checker sees."""

    def __init__(self, ownership: Ownership):
        self.ownership = ownership

    def __get__(self, held, owner=None):
        if held is None:
            return self
        self.ownership.touch(held)
        return held.__dict__["kept"]

    def __set__(self, held, value):
        held.__dict__["kept"] = value


def instrument(monkeypatch) -> Ownership:
    ownership = Ownership()
    hand, take_done, idle = Sender.hand, Sender.take_done, Sender.idle.fget
    chance = random.Random(36)

    def perturbed_idle(self):  # the worker's thread asks; the sender may finish meanwhile
        if chance.random() < 0.5:
            time.sleep(0.0002)
        return idle(self)

    def checked_hand(self, trip):
        ownership.handed(trip)
        return hand(self, trip)

    def checked_take_done(self):
        done = take_done(self)
        ownership.taken(done)
        return done

    monkeypatch.setattr(Sender, "hand", checked_hand)
    monkeypatch.setattr(Sender, "take_done", checked_take_done)
    monkeypatch.setattr(Sender, "idle", property(perturbed_idle))
    monkeypatch.setattr(Held, "kept", CheckedKept(ownership), raising=False)
    return ownership


def test_the_sender_and_the_worker_hand_helds_over_never_share_them(
    conn, keys, producer, monkeypatch
):
    bench = load()
    ownership = instrument(monkeypatch)
    engine = bench.StandInEngine(max_num_seqs=SEQS, step_s=0.0)
    config = WorkerConfig(
        prefix=keys.prefix,
        shards=keys.shards,
        name="w",
        audit_key=bench.AUDIT_KEY.encode(),
        burst=True,
        max_chunk_rate=0,
        block_ms=10,
    )
    ids = [f"h{i}" for i in range(JOBS)]
    unwritable = ids[::12]
    for rid in unwritable:  # its chunk log key a string: APPEND answers BAD_LOG
        conn.set(keys.for_request(rid).out(rid), "not a list")
    params = SamplingParams(max_tokens=TOKENS, ignore_eos=True)
    handles = producer.submit_many([PROMPT] * JOBS, params, request_ids=ids)

    worker = Worker(engine, conn, config, bench.BASE_MODEL)
    worker.ensure_group()
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        steps = 0
        while not worker.stopped and steps < 20 * JOBS * TOKENS // SEQS:
            worker.run_guarded()
            steps += 1
            if steps % 3 == 0:  # as _fail_step and fail_all_vanished: settle, then touch
                worker.publisher.flush(wait=True)
                for held in list(worker.held.values()):
                    held.whole()
    finally:
        sys.setswitchinterval(switch)
        worker.teardown()

    assert worker.stopped, "the burst did not end"
    assert ownership.violations[:5] == []
    assert ownership.touches["sender"] > JOBS and ownership.touches["worker"] > JOBS
    assert length(conn, keys, "audit") == JOBS  # every request ended, once
    assert length(conn, keys, "dead") == len(unwritable)
    for handle in handles:
        if handle.request_id not in unwritable:
            assert len(handle.result(timeout=10).outputs[0].token_ids) == TOKENS
