"""lorapool's RQ worker classes (``lorapool.batch.rq_worker``) against a real Redis: a
worker whose command thread read its UNSUBSCRIBE reply before the stop flag tripped (the
race a loaded machine loses) still stops within seconds. RQ's own classes wait up to a
minute there, on redis-py 8.2 without a bound (CI timed a batch test out on it)."""

from __future__ import annotations

import threading
import time
import uuid

import pytest
from rq import Queue

from lorapool.batch.rq_worker import COMMAND_POLL_S, SimpleWorker, Worker


@pytest.mark.parametrize("cls", [Worker, SimpleWorker])
def test_a_worker_stops_promptly_when_its_command_thread_read_the_unsubscribe_first(conn, cls):
    queue = Queue(f"test-rq-worker-{uuid.uuid4().hex[:10]}", connection=conn)
    worker = cls([queue], connection=conn)
    worker.subscribe()
    try:
        # The race, forced: the UNSUBSCRIBE goes out and its reply is read by the thread
        # (the channel is gone from the pubsub) while the stop flag is still up.
        worker.pubsub.unsubscribe()
        deadline = time.monotonic() + 10
        while worker.pubsub.subscribed and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not worker.pubsub.subscribed, "the thread never read the UNSUBSCRIBE reply"
        time.sleep(0.2)  # the thread is back in its wait, flag still up
        stopper = threading.Thread(target=worker.unsubscribe, daemon=True)
        started = time.monotonic()
        stopper.start()
        stopper.join(timeout=15)
        took = time.monotonic() - started
        assert not stopper.is_alive(), "unsubscribe still waiting after 15 s"
        assert took < COMMAND_POLL_S + 2, f"unsubscribe took {took:.1f} s"
        assert not worker.pubsub_thread.is_alive()
    finally:
        worker.pubsub.close()
        conn.delete(worker.key)
