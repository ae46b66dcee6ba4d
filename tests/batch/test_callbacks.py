"""Completion callbacks end to end: 100 jobs submitted with ``on_finish`` run on a real
worker, the audit writer commits their rows and enqueues one RQ job each (JSON, never
pickle), even when the same audit entries are handled twice; an rq worker runs them.
Webhooks: tests/batch/test_webhooks.py."""

from __future__ import annotations

import json
import time
import zlib

import orjson
import pytest

from lorapool import SamplingParams
from lorapool.audit_db import AuditWriter, DatabaseConfig, WriterConfig, create_audit_engine
from lorapool.audit_db.database import migrate
from lorapool.batch.callbacks import Callbacks, job_id
from lorapool.lifecycle.keys import Keys
from lorapool.producer import Producer
from lorapool.records.audit import parse_record

pytestmark = pytest.mark.usefixtures("worker")
TARGET = """
import orjson
from rq import get_current_job

def record(data):
    get_current_job().connection.rpush(data["metadata"]["sink"], orjson.dumps(data))
"""


@pytest.fixture
def writer(conn, prefix, tmp_path):
    engine = create_audit_engine(DatabaseConfig(url=f"sqlite:///{tmp_path / 'audit.sqlite'}"))
    migrate(engine)
    callbacks = Callbacks(conn, Keys(prefix), queue=prefix)
    yield AuditWriter(conn, engine, WriterConfig(prefix=prefix), on_commit=callbacks), callbacks
    for marker in conn.scan_iter(f"{prefix}:job:*"):  # each request's RQ callback job
        rid = marker.decode().split("{", 1)[1].rstrip("}")
        conn.delete(f"rq:job:{job_id(rid)}", f"rq:results:{job_id(rid)}")
    engine.dispose()


def test_100_finished_jobs_get_one_json_callback_each(
    conn, prefix, registry, writer, rq_worker, tmp_path
):
    (tmp_path / "cbtarget.py").write_text(TARGET)
    audit_writer, callbacks = writer
    producer, sink = Producer(conn, prefix=prefix), f"{prefix}:sink"
    names = [*registry, None]
    handles = [
        producer.submit(
            f"callback {i}",
            SamplingParams(max_tokens=4, temperature=0),
            names[i % len(names)],
            f"cb-{i}",
            {"sink": sink},
            on_finish="cbtarget.record",
        )
        for i in range(100)
    ]
    results = {h.request_id: h.result(timeout=120) for h in handles}
    time.sleep(0.5)  # the final records reach the audit stream with the final chunks
    entries = conn.xrange(f"{prefix}:audit")  # the writer trims them once committed
    audit_writer.run(burst=True)
    # the same entries handled again (a redelivery) enqueue nothing more
    records = [parse_record(fields[b"data"]) for _, fields in entries]
    assert len(records) == 100 and callbacks(records) == 0
    for key in conn.scan_iter(f"{prefix}:callback:*"):  # past the markers, RQ's unique ids
        conn.delete(key)
    assert callbacks(records) == 0
    for rid in results:  # JSON in RQ's hash, never pickle
        data = zlib.decompress(conn.hget(f"rq:job:{job_id(rid)}", "data"))
        assert not data.startswith(b"\x80") and json.loads(data)
    rq_worker("--burst", "-P", str(tmp_path)).wait(timeout=120)
    got = [orjson.loads(x) for x in conn.lrange(sink, 0, -1)]
    assert sorted(g["request_id"] for g in got) == sorted(results)
    for g in got:
        out, lora = results[g["request_id"]], results[g["request_id"]].lora_request
        assert g["text"] == out.outputs[0].text
        assert g["num_generated_tokens"] == len(out.outputs[0].token_ids)
        assert g["finish_reason"] == out.outputs[0].finish_reason
        if lora is None:
            assert g["adapter"] is None
        else:
            assert g["adapter"]["sha256"] == registry[lora.lora_name].sha256
            assert g["adapter"]["name"] == lora.lora_name
