"""Requests through a gateway with API keys end in audit rows that name their adapter
(with its weights' sha256), their tenant and the key that submitted them: a real
worker process, the audit writer, SQLite and PostgreSQL."""

from __future__ import annotations

import httpx
import openai
import pytest
from gateway_procs import free_port, start_gateway, stop, wait_until

from lorapool.audit_db import AuditWriter, WriterConfig
from lorapool.audit_db.queries import get_request
from lorapool.keys import Keys
from lorapool.producer.api_keys import ApiKeys

pytest_plugins = ["audit_fixtures"]
pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def tenant_key(conn, prefix):
    record, key = ApiKeys(conn, Keys(prefix)).add("acme", "submit")
    return record["id"], key


@pytest.fixture(scope="module")
def secure(redis_url, prefix, worker, tenant_key, tmp_path_factory):
    port = free_port()
    proc = start_gateway(redis_url, prefix, port, tmp_path_factory.mktemp("gw"), auth=True)
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        try:
            return httpx.get(f"{url}/readyz", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    wait_until(ready, "the gateway being ready", timeout=60)
    yield url
    stop(proc)


def test_audit_rows_name_adapter_tenant_and_key(
    secure, tenant_key, registry, conn, prefix, audit_target
):
    key_id, key = tenant_key
    client = openai.OpenAI(base_url=f"{secure}/v1", api_key=key, max_retries=0, timeout=120)
    done = client.completions.create(model="ad-qv", prompt="audit me", max_tokens=4)
    request_id = done.id.removeprefix("cmpl-")
    job = httpx.post(
        f"{secure}/v1/jobs",
        json={"model": "ad-mlp", "prompt": "and me", "max_tokens": 3},
        headers={"Authorization": f"Bearer {key}"},
    ).json()
    wait_until(
        lambda: (
            httpx.get(
                f"{secure}/v1/jobs/{job['id']}", headers={"Authorization": f"Bearer {key}"}
            ).json()["status"]
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
        assert row["request_metadata"] == {"tenant": "acme", "key_id": key_id}
        assert row["adapter_name"] == adapter
        assert row["adapter_sha256"] == registry[adapter]["sha256"]
        if text is not None:
            assert row["text"] == text
