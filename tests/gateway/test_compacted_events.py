"""Job events once the chunk log is compacted (a worker with --log-grace 1): the whole
output still reads as one event, a reader at the final seq gets nothing more, and a
reader that cannot be placed in the log is told so instead of getting repeats."""

from __future__ import annotations

import httpx
import pytest
from gateway_client import poll, read_events, submit
from gateway_procs import start_pool_worker, stop, wait_until

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def worker(redis_url, prefix, model, registry, conn, tmp_path_factory):
    """The pool's worker, keeping a finished request's log for 1 s only."""
    cwd = tmp_path_factory.mktemp("worker")
    proc = start_pool_worker(conn, redis_url, prefix, model, cwd, "--log-grace", "1")
    yield proc
    stop(proc)


def test_events_after_compaction(gateway, conn, prefix):
    body = {"model": "ad-qv", "prompt": "Once", "max_tokens": 30, "ignore_eos": True}
    job_id = submit(gateway, body).json()["id"]
    live = read_events(gateway, job_id)
    assert len(live) >= 3
    wait_until(lambda: not conn.exists(f"{prefix}:out:{{{job_id}}}"), "the log's compaction", 30)
    whole = poll(gateway, job_id)["result"]["outputs"][0]["text"]
    [(event_id, name, data)] = read_events(gateway, job_id)
    assert (event_id, name) == (live[-1][0], "chunk")
    assert data["outputs"][0]["text"] == whole and data["finished"]
    assert read_events(gateway, job_id, last_event_id=live[-1][0]) == []
    [(_, name, data)] = read_events(gateway, job_id, last_event_id=live[1][0])
    assert name == "error" and "compacted" in data["message"]
    assert httpx.get(f"{gateway}/v1/jobs/{job_id}").status_code == 200
