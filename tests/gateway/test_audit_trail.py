"""Requests through a gateway with API keys end in audit rows that name their adapter
(with its weights' sha256), their tenant and the key that submitted them; the audit
routes read them back scoped to the auditor's tenant. A real worker process, the audit
writer, SQLite and PostgreSQL."""

from __future__ import annotations

import csv
import io

import httpx
import openai
import orjson
import pytest
from gateway_procs import serve, stop, wait_until

from lorapool.audit_db import AuditWriter, WriterConfig
from lorapool.audit_db.queries import get_request
from lorapool.lifecycle.keys import Keys
from lorapool.producer.api_keys import ApiKeys

pytest_plugins = ["audit_fixtures"]
pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def keys(conn, prefix):
    store = ApiKeys(conn, Keys(prefix))
    made = {
        "acme": store.add("acme", "submit"),
        "globex": store.add("globex", "submit"),
        "acme-audit": store.add("acme", "audit"),
        "all-audit": store.add("compliance", "audit", all_tenants=True),
    }
    return {name: {"id": record.id, "key": key} for name, (record, key) in made.items()}


def _start(redis_url, prefix, cwd, *extra) -> tuple:
    return serve(redis_url, prefix, cwd, *extra, auth=True)


@pytest.fixture(scope="module")
def secure(redis_url, prefix, worker, keys, tmp_path_factory):
    url, proc = _start(redis_url, prefix, tmp_path_factory.mktemp("gw"))
    yield url
    stop(proc)


def auth(keys, name) -> dict:
    return {"Authorization": f"Bearer {keys[name]['key']}"}


def test_audit_rows_name_adapter_tenant_and_key(
    secure, keys, registry, conn, prefix, redis_url, audit_target, tmp_path
):
    client = openai.OpenAI(
        base_url=f"{secure}/v1", api_key=keys["acme"]["key"], max_retries=0, timeout=120
    )
    done = client.completions.create(model="ad-qv", prompt="audit me", max_tokens=4)
    assert "acme" not in done.id  # the response id names no tenant
    request_id = "acme~" + done.id.removeprefix("cmpl-")
    job = httpx.post(
        f"{secure}/v1/jobs",
        json={"model": "ad-mlp", "prompt": "and me", "max_tokens": 3},
        headers=auth(keys, "acme"),
    ).json()
    other = httpx.post(
        f"{secure}/v1/completions",
        json={"model": "ad-qv", "prompt": "not yours", "max_tokens": 2},
        headers=auth(keys, "globex"),
    ).json()
    wait_until(
        lambda: (
            httpx.get(f"{secure}/v1/jobs/{job['id']}", headers=auth(keys, "acme")).json()["status"]
            == "finished"
        ),
        "the job finishing",
    )
    AuditWriter(conn, audit_target.engine, WriterConfig(prefix=prefix)).run(burst=True)
    for rid, adapter, text in (
        (request_id, "ad-qv", done.choices[0].text),
        (f"acme~{job['id']}", "ad-mlp", None),
    ):
        [row] = get_request(audit_target.engine, rid)
        assert row["tenant"] == "acme"
        assert row["request_metadata"] == {"tenant": "acme", "key_id": keys["acme"]["id"]}
        assert row["adapter_name"] == adapter
        assert row["adapter_sha256"] == registry[adapter].sha256
        if text is not None:
            assert row["text"] == text
    db = ["--audit-db-url", audit_target.url]
    db += ["--audit-db-schema", audit_target.schema] if audit_target.schema else []
    url, proc = _start(redis_url, prefix, tmp_path, *db)
    try:
        # the response id names no tenant: an auditor of every tenant names the stored id
        check_audit_routes(url, keys, job["id"], "globex~" + other["id"].removeprefix("cmpl-"))
    finally:
        stop(proc)


def check_audit_routes(url: str, keys: dict, acme_job: str, globex_request: str) -> None:
    def get(path, who, headers=None, **kw):
        headers = {**auth(keys, who), **(headers or {})}
        return httpx.get(f"{url}/v1/audit{path}", headers=headers, timeout=30, **kw)

    mine = get(f"/completions/{acme_job}", "acme-audit")
    assert mine.status_code == 200, mine.text
    [row] = mine.json()["data"]
    assert (row["tenant"], row["adapter_name"]) == ("acme", "ad-mlp")
    assert get(f"/completions/{globex_request}", "acme-audit").status_code == 404
    assert get(f"/completions/{globex_request}", "all-audit").json()["data"][0]["tenant"] == (
        "globex"
    )
    assert get("/completions", "acme").status_code == 403  # a submit key

    acme_rows = get("/completions", "acme-audit").json()
    assert acme_rows["next_cursor"] is None
    assert {r["tenant"] for r in acme_rows["data"]} == {"acme"}
    assert get("/completions", "acme-audit", params={"tenant": "globex"}).status_code == 403
    every = get("/completions", "all-audit").json()["data"]
    assert {r["tenant"] for r in every} >= {"acme", "globex"}
    paged, cursor = [], None
    while True:
        params = {"limit": 1, **({"cursor": cursor} if cursor else {})}
        page = get("/completions", "all-audit", params=params).json()
        paged += page["data"]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert [r["seq"] for r in paged] == [r["seq"] for r in every]
    by_adapter = get("/completions", "all-audit", params={"adapter": "ad-mlp"}).json()["data"]
    assert {r["adapter_name"] for r in by_adapter} == {"ad-mlp"}

    exported = get("/export", "acme-audit", params={"format": "jsonl"}).text.splitlines()
    assert [orjson.loads(line)["seq"] for line in exported] == [r["seq"] for r in acme_rows["data"]]
    assert get("/export", "acme-audit", params={"tenant": "globex"}).status_code == 403
    table = get("/completions", "acme-audit", headers={"Accept": "text/csv"})
    assert table.headers["content-type"].startswith("text/csv")
    assert len(list(csv.DictReader(io.StringIO(table.text)))) == len(acme_rows["data"])

    usage = get("/usage", "all-audit", params={"group_by": "tenant"}).json()["data"]
    assert {u["key"] for u in usage} >= {"acme", "globex"}
    assert get("/usage", "acme-audit").status_code == 403  # by adapter: all tenants only
    [own] = get("/usage", "acme-audit", params={"group_by": "tenant"}).json()["data"]
    assert own["key"] == "acme" and own["requests"] == 2
    verified = get("/verify", "all-audit", params={"wait": 25})  # a job: wait for it
    assert verified.status_code == 200 and verified.json()["ok"], verified.text
    assert get("/verify", "acme-audit").status_code == 403
