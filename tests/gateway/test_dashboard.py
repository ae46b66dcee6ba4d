"""The dashboard in headless Chromium (Debian's package, driven by Playwright) during a
run of two real worker processes: an audit key logs in through the page's form, and the
page names both workers, the adapter a running job holds, the queue length Redis's
XLEN gives, and the audit row of a finished request. Also: /dashboard refuses a
submit key, and /metrics has the pool's gauges (escaping: test_dashboard_page.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import time

import httpx
import pytest
from gateway_procs import serve, start_pool_worker, stop, wait_until

from lorapool.audit_db import (
    AuditWriter,
    DatabaseConfig,
    WriterConfig,
    create_audit_engine,
    migrate,
)
from lorapool.lifecycle.keys import Keys
from lorapool.producer.api_keys import ApiKeys
from lorapool.records.heartbeat import decode_heartbeats

pytestmark = pytest.mark.integration
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# LORAPOOL_DASHBOARD_SCREENSHOT=docs/dashboard.png writes the README's picture
SCREENSHOT = os.environ.get("LORAPOOL_DASHBOARD_SCREENSHOT")


@pytest.fixture(scope="module")
def second_worker(redis_url, prefix, model, worker, conn, tmp_path_factory):
    cwd = tmp_path_factory.mktemp("worker2")
    proc = start_pool_worker(conn, redis_url, prefix, model, cwd, workers=2)
    yield proc
    stop(proc)


@pytest.fixture(scope="module")
def audit_db(tmp_path_factory):
    url = f"sqlite:///{tmp_path_factory.mktemp('audit') / 'audit.sqlite'}"
    engine = create_audit_engine(DatabaseConfig(url=url))
    migrate(engine)
    yield url, engine
    engine.dispose()


@pytest.fixture(scope="module")
def api_keys(conn, prefix):
    store = ApiKeys(conn, Keys(prefix))
    return {
        role: store.add("ops", role, all_tenants=role == "audit")[1] for role in ("submit", "audit")
    }


@pytest.fixture(scope="module")
def secure(redis_url, prefix, second_worker, audit_db, api_keys, tmp_path_factory):
    extra = ("--audit-db-url", audit_db[0])
    url, proc = serve(redis_url, prefix, tmp_path_factory.mktemp("gw"), *extra, auth=True)
    yield url
    stop(proc)


def _job(url: str, key: str, body: dict) -> str:
    headers = {"Authorization": f"Bearer {key}"}
    response = httpx.post(f"{url}/v1/jobs", json=body, headers=headers, timeout=30)
    assert response.status_code == 202, response.text
    return response.json()["id"]


def _live_names(conn, prefix) -> set[str]:
    """The names the live workers' records show (each record under its consumer)."""
    records = decode_heartbeats(conn.hgetall(f"{prefix}:workers"))
    return {h.name for c, h in records.items() if conn.exists(f"{prefix}:alive:{c}")}


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium (apt-get install chromium)")
def test_dashboard_shows_the_running_pool(secure, api_keys, conn, prefix, audit_db, tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api")
    submit = api_keys["submit"]
    short = {"model": "ad-mlp", "prompt": "audit me", "max_tokens": 3}
    finished = _job(secure, submit, short)
    poll_headers = {"Authorization": f"Bearer {submit}"}
    wait_until(
        lambda: (
            httpx.get(f"{secure}/v1/jobs/{finished}", headers=poll_headers).json()["status"]
            == "finished"
        ),
        "the short job finishing",
    )
    AuditWriter(conn, audit_db[1], WriterConfig(prefix=prefix)).run(burst=True)
    long = {"model": "ad-qv", "prompt": "Far away", "max_tokens": 480, "ignore_eos": True}
    running = []
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1200, "height": 900})
            page.goto(f"{secure}/dashboard?refresh=60")
            page.fill("input[name=key]", api_keys["audit"])
            page.click("button")
            page.wait_for_selector("#workers")
            # once the browser is up (slow on a busy machine): more than the two workers'
            # 16 sequences, and long, so that a queue stays put a while
            running += [_job(secure, submit, long) for _ in range(24)]
            workers = _live_names(conn, prefix)
            page.goto(f"{secure}/dashboard?refresh=60")  # the cookie now; no reload meanwhile
            shown = _shown_while_running(page, conn, prefix, secure)
            page.screenshot(path=SCREENSHOT or str(tmp_path / "dashboard.png"), full_page=True)
        finally:
            browser.close()
        for job_id in running:
            httpx.delete(f"{secure}/v1/jobs/{job_id}", headers=poll_headers)
    assert len(workers) == 2 and set(shown["workers"]) == workers
    assert "ad-qv" in shown["adapters"]
    assert shown["length"] == shown["xlen"] > 0
    audit_row = f"ops~{finished}"
    assert audit_row in shown["audit"]
    assert shown["links"][audit_row] == f"/v1/audit/completions/ops~{finished}"


def _shown_while_running(page, conn, prefix, url) -> dict:
    """Reloads until the page shows the running job's adapter and a queue length read
    between two equal XLENs (the stream does not change under the reading)."""
    deadline, tries = time.monotonic() + 90, []
    while True:
        before = conn.xlen(f"{prefix}:requests")
        page.reload()
        after = conn.xlen(f"{prefix}:requests")
        shown = {
            "workers": page.eval_on_selector_all(
                "td.worker", "els => els.map(e => e.dataset.name)"
            ),
            "adapters": " ".join(
                page.eval_on_selector_all("td.adapters", "els => els.map(e => e.textContent)")
            ),
            "length": int(page.inner_text("#queue-length")),
            "xlen": before,
            "audit": page.eval_on_selector_all(
                "td.request", "els => els.map(e => e.dataset.request)"
            ),
            "links": dict(
                page.eval_on_selector_all(
                    "td.request a", "els => els.map(a => [a.textContent, a.getAttribute('href')])"
                )
            ),
        }
        if before == after and "ad-qv" in shown["adapters"] and len(shown["workers"]) == 2:
            return shown
        tries.append((before, after, shown["length"], shown["adapters"]))
        assert time.monotonic() < deadline, f"never the running pool; (xlen, xlen, shown): {tries}"
        time.sleep(0.5)


def test_dashboard_needs_an_audit_or_admin_key(secure, api_keys):
    assert httpx.get(f"{secure}/dashboard").status_code == 401
    submitter = {"Authorization": f"Bearer {api_keys['submit']}"}
    assert httpx.get(f"{secure}/dashboard", headers=submitter).status_code == 403
    auditor = {"Authorization": f"Bearer {api_keys['audit']}"}
    page = httpx.get(f"{secure}/dashboard", headers=auditor)
    assert page.status_code == 200 and 'id="queue-length"' in page.text


def test_metrics_needs_an_audit_or_admin_key_and_has_the_pool_gauges(
    secure, conn, prefix, api_keys
):
    """The README's promise: /metrics to audit and admin keys (its series name tenants)."""
    from prometheus_client.parser import text_string_to_metric_families

    assert httpx.get(f"{secure}/metrics").status_code == 401
    submitter = {"Authorization": f"Bearer {api_keys['submit']}"}
    assert httpx.get(f"{secure}/metrics", headers=submitter).status_code == 403
    auditor = {"Authorization": f"Bearer {api_keys['audit']}"}
    body = httpx.get(f"{secure}/metrics", headers=auditor).text
    gauges = {f.name: f for f in text_string_to_metric_families(body)}
    assert gauges["lorapool_workers_live"].samples[0].value == 2
    assert gauges["lorapool_queue_length"].type == "gauge"
    assert gauges["lorapool_dead_letters"].samples[0].value == conn.xlen(f"{prefix}:dead")


def test_lorapool_dashboard_serves_the_page_alone(redis_url, prefix, conn, tmp_path):
    """``lorapool dashboard``: no keys, no audit links, the same queue length as XLEN."""
    from gateway_procs import free_port, lorapool_cmd, wait_answering

    port = free_port()
    cmd = lorapool_cmd("dashboard", "--port", str(port), "--redis-url", redis_url)
    proc = subprocess.Popen([*cmd, "--prefix", prefix], cwd=tmp_path)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_answering(proc, f"{url}/dashboard", "lorapool dashboard")
        page = httpx.get(f"{url}/dashboard").text
        length = conn.xlen(f"{prefix}:requests")
        assert f'id="queue-length">{length}<' in page
        assert "/v1/audit/completions/" not in page
        assert "lorapool_queue_length" in httpx.get(f"{url}/metrics").text
        assert httpx.post(f"{url}/v1/jobs", json={}).status_code == 404  # no gateway here
    finally:
        stop(proc)
