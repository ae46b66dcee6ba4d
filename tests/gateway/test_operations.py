"""Operations without a worker: Redis unreachable (503), backlog bound (429), the
OpenAPI description. Each test runs its own gateway process (no torch, quick)."""

from __future__ import annotations

import json
import re
import time

import httpx
import pytest
from gateway_procs import free_port, serve, stop

pytestmark = pytest.mark.integration
JOB = {"model": "base", "prompt": "hello", "max_tokens": 2}


@pytest.fixture
def gateway_on(tmp_path):
    """Factory: the URL of a gateway started with these arguments, once it answers."""
    procs = []

    def start(redis_url: str, prefix: str, *extra: str) -> str:
        url, proc = serve(redis_url, prefix, tmp_path, *extra)
        procs.append(proc)
        return url

    yield start
    for proc in procs:
        stop(proc)


def test_redis_unreachable_is_503(gateway_on):
    url = gateway_on(f"redis://127.0.0.1:{free_port()}/0", "nowhere")
    assert httpx.get(f"{url}/healthz").status_code == 200
    ready = httpx.get(f"{url}/readyz", timeout=30)
    assert ready.status_code == 503 and "unreachable" in ready.json()["reason"]
    started = time.monotonic()
    response = httpx.post(f"{url}/v1/completions", json=JOB, timeout=30)
    assert response.status_code == 503, response.text
    assert response.json()["error"]["code"] == "redis_unavailable"
    assert time.monotonic() - started < 10
    assert httpx.get(f"{url}/v1/models", timeout=30).status_code == 503


def test_backlog_bound_gives_429_and_keeps_what_was_accepted(
    gateway_on, redis_url, prefix, conn, base_name
):
    """No worker on this prefix: two jobs wait, the third is refused, none is lost."""
    backlog_prefix = f"{prefix}-backlog"
    conn.set(f"{backlog_prefix}:model", b'{"name": "base", "sha256": "0"}')
    url = gateway_on(redis_url, backlog_prefix, "--max-backlog", "2")
    try:
        ids = [httpx.post(f"{url}/v1/jobs", json=JOB).json()["id"] for _ in range(2)]
        refused = httpx.post(f"{url}/v1/jobs", json=JOB)
        assert refused.status_code == 429
        assert refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "backlog_full"
        assert httpx.post(f"{url}/v1/completions", json=JOB).status_code == 429
        # scale from zero: ready (it takes submissions) with no worker, which it reports
        ready = httpx.get(f"{url}/readyz")
        assert ready.status_code == 200 and ready.json()["workers"] == 0
        serving = httpx.get(f"{url}/readyz", params={"min_workers": 1})
        assert serving.status_code == 503 and serving.json()["workers"] == 0
        for place, job_id in enumerate(ids):
            job = httpx.get(f"{url}/v1/jobs/{job_id}").json()
            assert job["status"] == "queued" and job["backlog"] == 2
            assert job["position"] == place
        assert conn.xlen(f"{backlog_prefix}:requests") == 2
        # a worker's read, as Redis sees it: the first entry delivered, the second next
        stream = f"{backlog_prefix}:requests"
        # the gateway made the workers' group at its start (KEDA's pending count needs it)
        assert [g["name"] for g in conn.xinfo_groups(stream)] == [b"workers"]
        conn.xreadgroup("workers", "someone", {stream: ">"}, count=1)
        first, second = (httpx.get(f"{url}/v1/jobs/{i}").json() for i in ids)
        assert "position" not in first and first["backlog"] == 1
        assert second["position"] == 0 and second["backlog"] == 1
    finally:
        for key in conn.scan_iter(f"{backlog_prefix}:*"):
            conn.delete(key)


def test_scale_from_zero_queues_and_says_no_worker_in_time(gateway_on, redis_url, prefix, conn):
    """No worker: the gateway is ready, takes the calls, and after --queue-timeout answers
    503 no_worker (a stream: an error event) naming the jobs, which stay queued."""
    import openai

    zero = f"{prefix}-zero"
    conn.set(f"{zero}:model", b'{"name": "base", "sha256": "0"}')
    url = gateway_on(redis_url, zero, "--queue-timeout", "1")
    try:
        assert httpx.get(f"{url}/readyz").json() == {
            "status": "ready",
            "model": "base",
            "workers": 0,
        }
        started = time.monotonic()
        late = httpx.post(f"{url}/v1/completions", json=JOB, timeout=30)
        assert 1 <= time.monotonic() - started < 10
        assert late.status_code == 503 and late.json()["error"]["code"] == "no_worker"
        assert late.headers["retry-after"] == "1"
        job_id = late.json()["error"]["message"].split("as job ")[1].split(" ")[0]
        queued = httpx.get(f"{url}/v1/jobs/{job_id}").json()
        assert queued["status"] == "queued" and queued["position"] == 0
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        stream = client.chat.completions.create(
            model="base", messages=[{"role": "user", "content": "hi"}], max_tokens=2, stream=True
        )
        with pytest.raises(openai.APIError, match="no worker took the request within 1s"):
            list(stream)
        assert conn.xlen(f"{zero}:requests") == 2  # both kept for the worker to come
        assert not conn.exists(f"{zero}:abort:{job_id}")
    finally:
        for key in conn.scan_iter(f"{zero}:*"):
            conn.delete(key)


def test_openapi_describes_every_endpoint(gateway):
    paths = httpx.get(f"{gateway}/openapi.json").json()["paths"]
    for path in (
        "/healthz",
        "/readyz",
        "/v1/models",
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/jobs",
        "/v1/jobs/{job_id}",
        "/v1/jobs/{job_id}/events",
        "/v1/models/{model_id}",
        "/v1/responses",
        "/v1/responses/{response_id}",
        "/v1/responses/{response_id}/input_items",
        "/v1/responses/{response_id}/cancel",
    ):
        assert path in paths
    assert httpx.get(f"{gateway}/docs").status_code == 200
    document = httpx.get(f"{gateway}/openapi.json").json()
    schemas = document["components"]["schemas"]
    for path, models in (
        ("/v1/completions", ["CompletionRequest"]),
        ("/v1/chat/completions", ["ChatRequest"]),
        ("/v1/jobs", ["CompletionJob", "ChatJob"]),
        ("/v1/responses", ["ResponsesRequest"]),
    ):
        body = paths[path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        refs = [{"$ref": f"#/components/schemas/{model}"} for model in models]
        assert body == (refs[0] if len(refs) == 1 else {"anyOf": refs})
        for model in models:
            assert "model" in schemas[model]["properties"]
    refs = re.findall(r'"\$ref": ?"#/components/schemas/([^"]+)"', json.dumps(document))
    assert refs and set(refs) <= set(schemas)  # every reference resolves


def test_cors_for_a_configured_origin_only(gateway_on, redis_url, prefix):
    url = gateway_on(redis_url, prefix, "--cors-origin", "https://app.example")
    preflight = {
        "Access-Control-Request-Method": "GET",
        "Access-Control-Request-Headers": "Last-Event-ID, Authorization",
    }
    allowed = httpx.options(
        f"{url}/v1/jobs/x/events", headers={"Origin": "https://app.example", **preflight}
    )
    assert allowed.status_code == 200
    assert allowed.headers["access-control-allow-origin"] == "https://app.example"
    other = httpx.options(
        f"{url}/v1/jobs/x/events", headers={"Origin": "https://evil.example", **preflight}
    )
    assert "access-control-allow-origin" not in other.headers


def test_the_demo_shows_the_gateway(gateway, redis_url, prefix, tmp_path, monkeypatch):
    import io

    from rich.console import Console

    from lorapool.cli.demo_gateway import show_gateway

    monkeypatch.setenv("LORAPOOL_CACHE_DIR", str(tmp_path))
    out = io.StringIO()
    show_gateway(redis_url, prefix, Console(file=out, width=200), adapter="ad-qv")
    shown = out.getvalue()
    assert "client.chat.completions.create(model='ad-qv'" in shown
    assert "202 Location: /v1/jobs/" in shown and "finished:" in shown
    assert "adapter ad-qv (sha256" in shown
