"""A batch belongs to the tenant that made it: another tenant finds neither the batch
nor its files (as with jobs: 404, revealing nothing), and every line's job carries the
owner's tenant and key id, so its audit row names them (real Redis, a real worker and
an rq worker)."""

from __future__ import annotations

import io
import time

import orjson
import pytest

from lorapool.batch import BatchError
from lorapool.records.job import DATA

pytestmark = pytest.mark.usefixtures("worker")
OWNER = {"tenant": "acme", "key_id": "k-acme"}


def test_a_batch_is_its_tenants_alone(make_lines, service, rq_worker, registry, conn, prefix):
    lines = make_lines(6, list(registry))
    data = b"".join(orjson.dumps(x) + b"\n" for x in lines)
    upload = service.upload(io.BytesIO(data), "in.jsonl", tenant="acme")
    with pytest.raises(BatchError) as refused:  # another tenant cannot batch acme's file
        service.create(upload["id"], "/v1/completions", owner={"tenant": "other"})
    assert refused.value.status == 404
    batch = service.create(upload["id"], "/v1/completions", owner=OWNER)
    rq_worker()
    deadline = time.monotonic() + 240
    while (done := service.retrieve(batch["id"]))["status"] not in ("completed", "failed"):
        assert time.monotonic() < deadline, f"batch stuck in {done['status']}"
        time.sleep(0.2)
    assert done["request_counts"]["completed"] == 6
    assert "owner" not in done and "owner" not in service.file(upload["id"])

    others = [
        lambda: service.retrieve(batch["id"], "other"),
        lambda: service.cancel(batch["id"], "other"),
        lambda: service.file(upload["id"], "other"),
        lambda: service.file(done["output_file_id"], "other"),
        lambda: list(service.content(done["output_file_id"], "other")),
        lambda: service.file(done["error_file_id"], ""),  # no tenant is not acme either
    ]
    for call in others:
        with pytest.raises(BatchError) as missing:
            call()
        assert missing.value.status == 404 and "acme" not in str(missing.value)
    assert service.retrieve(batch["id"], "acme")["id"] == batch["id"]
    output = list(service.content(done["output_file_id"], "acme"))
    assert len(output) == 6
    assert service.retrieve(batch["id"])["id"] == batch["id"]  # the CLI: no tenant check

    audits = [orjson.loads(f[DATA.encode()]) for _, f in conn.xrange(f"{prefix}:audit")]
    mine = [a for a in audits if a["request_id"].startswith(batch["id"] + ":")]
    assert len(mine) == 6
    assert all(a["metadata"] == {"batch_id": batch["id"], **OWNER} for a in mine)
