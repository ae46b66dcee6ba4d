"""Issue 51 ("one tenant cannot take the service from the others"), rows 8 and 9, over a
real ``lorapool serve`` with keys and a seeded audit database (SQLite and PostgreSQL):

- row 8: a tenant's audit key read its own rows with ``adapter_path`` (a server path),
  the worker's name and the submitting key's id, which the README says a tenant's key
  never sees; an admin key and an auditor of every tenant still see them, and so does
  a tenant's auditor where the gateway says so (``--tenant-audit-internals``);
- row 9: a prompt ``X;=1+1;x`` was exported as CSV raw and unquoted, so a spreadsheet
  in a ``;``-separated locale read ``=1+1`` as a formula.
"""

from __future__ import annotations

import csv
import io
import os
import re
import subprocess

import httpx
import orjson
import pytest
from audit_fixtures import KEY, make_adapter, make_record
from gateway_procs import free_port, lorapool_cmd, stop, wait_answering

from lorapool.audit_db import append_records
from lorapool.lifecycle.keys import Keys
from lorapool.producer import Producer
from lorapool.producer.api_keys import ApiKeys
from lorapool.protocol import SamplingParams
from lorapool.records.audit import record_from_dict

pytest_plugins = ["audit_fixtures"]
pytestmark = pytest.mark.integration
ROW9 = "X;=1+1;x"
FORMULA = ("=", "+", "-", "@", "\t", "\r")


@pytest.fixture
def keys(conn, prefix):
    store = ApiKeys(conn, Keys(prefix))
    made = {
        "acme-audit": store.add("acme", "audit"),
        "all-audit": store.add("compliance", "audit", all_tenants=True),
        "acme": store.add("acme", "submit"),
    }
    return {name: {"Authorization": f"Bearer {key}"} for name, (_, key) in made.items()}


def _gateway(redis_url, prefix, target, cwd, **env):
    port = free_port()
    cmd = lorapool_cmd(
        "serve", "--port", str(port), "--prefix", prefix, "--redis-url", redis_url,
        "--log-level", "warning", "--audit-db-url", target.url,
        *(["--audit-db-schema", target.schema] if target.schema else []),
    )  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=cwd, env={**os.environ, **env})
    url = f"http://127.0.0.1:{port}"
    wait_answering(proc, f"{url}/healthz", "the gateway")
    return url, proc


@pytest.fixture
def seeded(audit_target):
    """Two requests of tenant acme, through an adapter, sent with key id k-acme-1."""
    records = [make_record(i, adapter=make_adapter()) for i in range(2)]
    for record in records:
        record["metadata"]["key_id"] = "k-acme-1"
        record["request_id"] = "acme~" + record["request_id"]  # as the gateway submits
    records[0]["prompt"] = ROW9
    append_records(audit_target.engine, [record_from_dict(r) for r in records], key=KEY)
    return audit_target


@pytest.fixture
def audit_gateway(redis_url, prefix, seeded, keys, tmp_path):
    url, proc = _gateway(redis_url, prefix, seeded, tmp_path)
    yield url
    stop(proc)


def _rows(url: str, who: dict, request_id: str = "req-0") -> list[dict]:
    """The rows every route gives ``who``: one request's, a page, the JSON Lines export."""

    def get(path, **params):
        answer = httpx.get(f"{url}/v1/audit{path}", headers=who, params=params, timeout=30)
        assert answer.status_code == 200, answer.text
        return answer

    one = get(f"/completions/{request_id}").json()["data"]
    page = get("/completions").json()["data"]
    exported = [orjson.loads(line) for line in get("/export").text.splitlines()]
    assert len(page) == len(exported) == 2 and len(one) == 1
    return one + page + exported


def _csv_rows(url: str, who: dict) -> list[dict]:
    headers = {**who, "Accept": "text/csv"}
    page = httpx.get(f"{url}/v1/audit/completions", headers=headers, timeout=30)
    exported = httpx.get(f"{url}/v1/audit/export", headers=who, params={"format": "csv"})
    rows = []
    for answer in (page, exported):
        assert answer.status_code == 200, answer.text
        rows += list(csv.DictReader(io.StringIO(answer.text, newline="")))
    return rows


def _internals(row: dict) -> dict:
    metadata = row.get("request_metadata")
    if isinstance(metadata, str):  # a CSV cell: JSON (neutralised, which adds only ')
        metadata = orjson.loads(metadata.replace("'", ""))
    found = {k: row[k] for k in ("adapter_path", "worker") if row.get(k)}
    if metadata and "key_id" in metadata:
        found["key_id"] = metadata["key_id"]
    return found


# Row 8: what a tenant's auditor sees
def test_row8_a_tenants_auditor_sees_no_server_path_worker_or_key_id(audit_gateway, keys):
    for row in _rows(audit_gateway, keys["acme-audit"]) + _csv_rows(
        audit_gateway, keys["acme-audit"]
    ):
        assert _internals(row) == {}, row
        assert row["tenant"] == "acme" and row["adapter_name"] == "sql-lora"  # the rest is there
        assert row["adapter_sha256"] == make_adapter()["sha256"]
    expected = {"adapter_path": make_adapter()["path"], "worker": "worker-0"}
    everyone = keys["all-audit"]  # the operator's auditor: all of it, by the stored ids
    for row in _rows(audit_gateway, everyone, "acme~req-0"):
        assert _internals(row) == {**expected, "key_id": "k-acme-1"}, row


def test_row8_the_option_shows_them_to_a_tenants_auditor(redis_url, prefix, seeded, keys, tmp_path):
    env = {"LORAPOOL_TENANT_AUDIT_INTERNALS": "1"}
    url, proc = _gateway(redis_url, prefix, seeded, tmp_path, **env)
    try:
        for row in _rows(url, keys["acme-audit"]):
            assert _internals(row)["key_id"] == "k-acme-1", row
            assert row["adapter_path"] == make_adapter()["path"], row
    finally:
        stop(proc)


# Row 9: CSV read in any locale
def test_row9_no_csv_cell_starts_a_formula_whatever_the_separator(audit_gateway, keys):
    who = keys["acme-audit"]
    headers = {**who, "Accept": "text/csv"}
    page = httpx.get(f"{audit_gateway}/v1/audit/completions", headers=headers, timeout=30)
    exported = httpx.get(f"{audit_gateway}/v1/audit/export", headers=who, params={"format": "csv"})
    for answer in (page, exported):
        assert answer.status_code == 200, answer.text
        # a reader splitting on any locale's separator, a line break or a quote it
        # does not honour: no piece it may take for a cell starts a formula (numbers apart)
        for piece in re.split('[,;\t|\r\n"]', answer.text):
            text = piece.lstrip(" ")
            if text.startswith(FORMULA):
                float(text)  # a number (-1.5), else this raises
        # read as written, the prompt differs from what was sent by the added ' alone
        prompts = [r["prompt"] for r in csv.DictReader(io.StringIO(answer.text, newline=""))]
        assert "X;'=1+1;x" in prompts, prompts


def test_an_audit_export_counts_against_the_tenants_long_lived_requests(
    redis_url, prefix, conn, seeded, keys, tmp_path
):
    """An export read slowly holds a database cursor and a thread: with a cap of one, a
    tenant holding a job-events stream gets 429 on its export (row 5's caps)."""
    Producer(conn, prefix=prefix).submit(
        "waits", SamplingParams(max_tokens=1), request_id="acme~held"
    )
    env = {"LORAPOOL_MAX_STREAMS_PER_TENANT": "1"}
    url, proc = _gateway(redis_url, prefix, seeded, tmp_path, **env)
    try:
        with httpx.stream("GET", f"{url}/v1/jobs/held/events", headers=keys["acme"]) as events:
            assert events.status_code == 200
            reading = events.iter_raw()
            next(reading)  # held
            export = httpx.get(f"{url}/v1/audit/export", headers=keys["acme-audit"], timeout=30)
            assert export.status_code == 429, export.text
            assert export.json()["error"]["code"] == "too_many_streams"
    finally:
        stop(proc)
