"""Batches end to end on real Redis, a real lorapool worker and real RQ workers: every
line's output equals the engine's offline API for the same request (greedy)."""

from __future__ import annotations

import io
import time
import zlib

import orjson
import pytest

from lorapool.batch import Status
from lorapool.lifecycle.keys import Keys

pytestmark = pytest.mark.usefixtures("worker")


def upload(service, lines: list[dict], extra: bytes = b"") -> str:
    data = b"".join(orjson.dumps(line) + b"\n" for line in lines) + extra
    return service.upload(io.BytesIO(data), "in.jsonl")["id"]


def wait_for(service, batch_id: str, statuses: set[Status], timeout: float = 240) -> dict:
    deadline = time.monotonic() + timeout
    while (batch := service.retrieve(batch_id))["status"] not in statuses:
        assert time.monotonic() < deadline, f"batch stuck in {batch['status']}"
        time.sleep(0.2)
    return batch


def wait_completed(service, batch_id: str, count: int, timeout: float = 120) -> None:
    """Until ``count`` of the batch's lines have completed (the batch still running)."""
    deadline = time.monotonic() + timeout
    while service.retrieve(batch_id)["request_counts"]["completed"] < count:
        assert time.monotonic() < deadline, f"{count} lines did not complete in {timeout}s"
        time.sleep(0.05)


def read(service, file_id: str | None) -> list[dict]:
    return [] if file_id is None else [orjson.loads(x) for x in service.content(file_id)]


def test_a_mixed_batch_equals_the_offline_engine(
    make_lines, service, rq_worker, oracle, registry, base_name, conn, prefix
):
    lines = make_lines(24, [*registry, base_name])
    batch = service.create(upload(service, lines), "/v1/completions")
    assert batch["status"] == "validating"
    rq_worker()
    done = wait_for(service, batch["id"], {"completed", "failed"})
    assert done["status"] == "completed", done
    assert done["request_counts"] == {"total": 24, "completed": 24, "failed": 0}
    outputs = read(service, done["output_file_id"])
    assert [o["custom_id"] for o in outputs] == [line["custom_id"] for line in lines]
    for line, out in zip(lines, outputs):
        expected = oracle(line).outputs[0]
        body = out["response"]["body"]
        choice = body["choices"][0]
        text = choice["message"]["content"] if "messages" in line["body"] else choice["text"]
        assert text == expected.text, line
        assert body["usage"]["completion_tokens"] == len(expected.token_ids)
        assert out["response"]["status_code"] == 200 and out["error"] is None
        assert out["response"]["request_id"] == f"{batch['id']}:{line['custom_id']}"
        rid = out["response"]["request_id"]
        assert conn.hget(Keys(prefix).job(rid), "priority") == b"batch"  # the batch stream
        assert body["model"] == line["body"]["model"]
    assert done["error_file_id"] is None
    for step in ("validate-batch", "enqueue-lines", "collect"):  # JSON in RQ, never pickle
        data = zlib.decompress(conn.hget(f"rq:job:{batch['id']}-{step}", "data"))
        assert not data.startswith(b"\x80") and orjson.loads(data)[2][0] == batch["id"]


def test_a_bad_file_fails_validating_with_every_reason_and_enqueues_nothing(
    make_lines, service, rq_worker, registry, conn, prefix
):
    lines = make_lines(6, list(registry))
    lines[3]["custom_id"] = lines[1]["custom_id"]  # line 4 repeats line 2
    lines[4]["body"]["model"] = "no-such-adapter"  # line 5
    keys = Keys(prefix)
    before = conn.xlen(keys.requests), conn.xlen(keys.batch_requests)
    batch = service.create(upload(service, lines, b'{"custom_id": "x", "met\n'), "/v1/completions")
    rq_worker()
    done = wait_for(service, batch["id"], {"completed", "failed"})
    assert done["status"] == "failed"
    errors = {e["line"]: e for e in done["errors"]["data"]}
    assert sorted(errors) == [4, 5, 7]
    assert errors[4]["param"] == "custom_id" and "repeats line 2" in errors[4]["message"]
    assert errors[5]["message"] == "line 5: unknown model 'no-such-adapter'"
    assert "not valid JSON" in errors[7]["message"]
    assert (conn.xlen(keys.requests), conn.xlen(keys.batch_requests)) == before
    assert not list(conn.scan_iter(f"{prefix}:job:{{{batch['id']}:*"))


def test_cancel_in_the_middle_keeps_the_finished_lines(
    make_lines, service, rq_worker, registry, conn, prefix
):
    lines = make_lines(40, list(registry), max_tokens=48)
    batch = service.create(upload(service, lines), "/v1/completions")
    rq_worker()
    wait_completed(service, batch["id"], 3)
    assert service.cancel(batch["id"])["status"] == "cancelling"
    done = wait_for(service, batch["id"], {"cancelled", "completed"})
    assert done["status"] == "cancelled", done
    counts = done["request_counts"]
    outputs, errors = read(service, done["output_file_id"]), read(service, done["error_file_id"])
    assert counts["completed"] == len(outputs) >= 3 and counts["failed"] == len(errors) > 0
    assert counts["completed"] + counts["failed"] == counts["total"] == 40
    finished = {o["custom_id"] for o in outputs}
    assert all(o["response"]["body"]["choices"][0]["finish_reason"] != "abort" for o in outputs)
    assert {e["error"]["code"] for e in errors} == {"batch_cancelled"}
    assert finished | {e["custom_id"] for e in errors} == {x["custom_id"] for x in lines}


def test_500_lines_each_run_once_and_audited_with_the_batch_id(
    make_lines, service, rq_worker, oracle, registry, base_name, conn, prefix, tmp_path
):
    from sqlalchemy import select

    from lorapool.audit_db import AuditWriter, DatabaseConfig, WriterConfig, create_audit_engine
    from lorapool.audit_db.database import migrate
    from lorapool.audit_db.schema import completions

    lines = make_lines(500, [*registry, base_name])
    started = time.monotonic()
    batch = service.create(upload(service, lines), "/v1/completions")
    rq_worker()
    done = wait_for(service, batch["id"], {"completed", "failed"}, timeout=600)
    elapsed = time.monotonic() - started
    assert done["request_counts"] == {"total": 500, "completed": 500, "failed": 0}, elapsed
    outputs = read(service, done["output_file_id"])
    assert [o["custom_id"] for o in outputs] == [x["custom_id"] for x in lines]
    for line, out in zip(lines, outputs, strict=True):  # the oracle on every line
        choice = out["response"]["body"]["choices"][0]
        text = choice["message"]["content"] if "messages" in line["body"] else choice["text"]
        assert text == oracle(line).outputs[0].text
    engine = create_audit_engine(DatabaseConfig(url=f"sqlite:///{tmp_path / 'audit.sqlite'}"))
    migrate(engine)
    AuditWriter(conn, engine, WriterConfig(prefix=prefix)).run(burst=True)
    with engine.connect() as db:
        rows = db.execute(select(completions.c.request_id, completions.c.request_metadata)).all()
    mine = [r for r in rows if r.request_id.startswith(batch["id"] + ":")]
    assert sorted(r.request_id for r in mine) == sorted(
        f"{batch['id']}:{x['custom_id']}" for x in lines
    )
    assert all(r.request_metadata["batch_id"] == batch["id"] for r in mine)
    engine.dispose()


def test_a_worker_killed_midway_the_batch_completes_each_line_once(
    make_lines, service, rq_worker, registry, conn, prefix, redis_url, model, tmp_path
):
    import signal

    from gateway_procs import start_worker, stop

    from lorapool.audit_db import AuditWriter, DatabaseConfig, WriterConfig, create_audit_engine
    from lorapool.audit_db.database import migrate

    doomed = start_worker(redis_url, prefix, model, tmp_path)
    lines = make_lines(60, list(registry), max_tokens=40)
    batch = service.create(upload(service, lines), "/v1/completions")
    rq_worker()
    wait_completed(service, batch["id"], 5)
    doomed.send_signal(signal.SIGKILL)  # its requests in flight are reclaimed by the other
    doomed.wait()
    replacement = start_worker(redis_url, prefix, model, tmp_path)
    try:
        done = wait_for(service, batch["id"], {"completed", "failed"})
    finally:
        stop(replacement)
    assert done["request_counts"] == {"total": 60, "completed": 60, "failed": 0}
    outputs = read(service, done["output_file_id"])
    assert [o["custom_id"] for o in outputs] == [x["custom_id"] for x in lines]
    engine = create_audit_engine(DatabaseConfig(url=f"sqlite:///{tmp_path / 'audit.sqlite'}"))
    migrate(engine)
    stats = AuditWriter(conn, engine, WriterConfig(prefix=prefix)).run(burst=True)
    engine.dispose()
    assert stats.duplicates == 0 and stats.conflicts == 0


@pytest.mark.slow
def test_the_rq_worker_killed_in_the_collector_a_new_one_finishes(
    make_lines, service, rq_worker, registry
):
    """RQ finds the killed worker's job abandoned once its heartbeat lapses (the job
    monitoring interval + 60 s) and retries it; the collector starts over."""
    import os
    import signal

    lines = make_lines(40, list(registry), max_tokens=40)
    batch = service.create(upload(service, lines), "/v1/completions")
    first = rq_worker(
        "--job-monitoring-interval", "1", worker_class="lorapool.batch.rq_worker.Worker"
    )
    deadline = time.monotonic() + 120
    while service.retrieve(batch["id"])["request_counts"]["completed"] < 3:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    with open(f"/proc/{first.pid}/task/{first.pid}/children") as f:
        children = f.read().split()
    # The worker first, then its work horse (its own group): killed the other way round,
    # the worker can see its horse die, mark the job failed and schedule its retry on its
    # own scheduler before it dies, and the retry then waits for the dead worker's
    # scheduler lock to lapse (CI, 2026-12-06: stuck past 200 s). This test is of the
    # other path: a job abandoned with its worker.
    for pid in [first.pid, *map(int, children)]:
        os.kill(pid, signal.SIGKILL)
    first.wait()
    assert children and service.retrieve(batch["id"])["request_counts"]["completed"] < 40
    rq_worker("--maintenance-interval", "1", "--worker-ttl", "20")
    done = wait_for(service, batch["id"], {"completed", "failed"}, timeout=200)
    assert done["request_counts"] == {"total": 40, "completed": 40, "failed": 0}
    outputs = read(service, done["output_file_id"])
    assert [o["custom_id"] for o in outputs] == [x["custom_id"] for x in lines]


def test_cancelled_while_validating_enqueues_nothing(make_lines, service, rq_worker, registry):
    batch = service.create(upload(service, make_lines(4, list(registry))), "/v1/completions")
    assert service.cancel(batch["id"])["status"] == "cancelling"
    rq_worker("--burst").wait(timeout=60)
    done = service.retrieve(batch["id"])
    assert done["status"] == "cancelled" and done["cancelled_at"] is not None
    assert done["output_file_id"] is None and done["request_counts"]["completed"] == 0


def test_past_its_window_a_batch_expires_with_its_lines_in_the_error_file(
    make_lines, service, rq_worker, registry
):
    lines = make_lines(30, list(registry), max_tokens=40)
    batch = service.create(upload(service, lines), "/v1/completions")
    service.state.set(batch["id"], expires_at=int(time.time()))  # the window is over
    rq_worker()
    done = wait_for(service, batch["id"], {"expired", "completed", "failed"})
    assert done["status"] == "expired"
    errors = read(service, done["error_file_id"])
    finished = read(service, done["output_file_id"])
    assert len(errors) + len(finished) == 30 and len(errors) > 0
    assert {e["error"]["code"] for e in errors} == {"batch_expired"}
