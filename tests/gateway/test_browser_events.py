"""A browser's EventSource on /v1/jobs/{id}/events, in headless Chromium (Debian's
package, driven by Playwright): the gateway ends each events response after 0.3 s
(--events-max-s), the EventSource reconnects with Last-Event-ID, and the page shows the
job's whole text once, in order, its event ids without gaps or repeats."""

from __future__ import annotations

import shutil
import threading

import httpx
import pytest
from fastapi.responses import HTMLResponse
from gateway_client import poll
from gateway_procs import free_port, wait_until

from lorapool.gateway import GatewayConfig, create_app

pytestmark = pytest.mark.integration
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
PAGE = """<!doctype html><pre id="out"></pre><script>
function follow(id) {
  const source = new EventSource(`/v1/jobs/${id}/events`);
  let text = "", opens = 0;
  const ids = [];
  source.addEventListener("open", () => { opens += 1; });
  source.addEventListener("chunk", (event) => {
    const chunk = JSON.parse(event.data);
    ids.push(Number(event.lastEventId));
    for (const out of chunk.outputs) if (out.index === 0) text += out.text;
    document.getElementById("out").textContent = text;
    if (chunk.finished) { source.close(); window.done = {text, opens, ids}; }
  });
}
</script>"""


@pytest.fixture
def same_origin(redis_url, prefix, worker):
    """An in-process gateway that also serves the test page (same origin: no CORS)."""
    import uvicorn

    config = GatewayConfig(redis_url=redis_url, prefix=prefix, auth=False, events_max_s=0.3)
    app = create_app(config)
    app.add_api_route("/page", lambda: HTMLResponse(PAGE), include_in_schema=False)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: server.started, "the in-process gateway starting", 30)
    yield url
    server.should_exit = True
    thread.join(timeout=15)


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium (apt-get install chromium)")
def test_event_source_resumes_across_closed_connections(same_origin):
    sync_api = pytest.importorskip("playwright.sync_api")
    body = {"model": "ad-qv", "prompt": "Far away", "max_tokens": 400, "ignore_eos": True}
    body |= {"temperature": 0, "n": 8}  # 8 sequences a step: a few seconds on the CPU
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            page = browser.new_page()
            page.goto(f"{same_origin}/page")
            job_id = httpx.post(f"{same_origin}/v1/jobs", json=body).json()["id"]
            page.evaluate(f"follow({job_id!r})")
            page.wait_for_function("window.done !== undefined", timeout=120_000)
            shown = page.evaluate("window.done")
            on_page = page.inner_text("#out")
        finally:
            browser.close()
    whole = poll(same_origin, job_id)["result"]["outputs"][0]["text"]
    assert shown["text"] == whole and on_page == whole
    assert shown["ids"] == list(range(len(shown["ids"])))
    assert shown["opens"] >= 2, f"never cut, nothing resumed: {shown['opens']} opens"
