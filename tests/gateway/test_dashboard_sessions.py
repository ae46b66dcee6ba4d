"""Row 6 and 14 of issue 32: dashboard sessions, in headless Chromium and over HTTP.

The gateway serves TLS (a self-signed certificate made here), with keys and an audit
database. Chromium logs in through the page's form: the cookie holds a signed random
session, not the key, and is HttpOnly, Secure, SameSite=Strict and expires with the
session; logging out ends it. A form on another origin cannot log the browser in
(login CSRF). Over HTTP: wrong tries are throttled per client address, the old
key-in-a-cookie and forged or revoked sessions are refused, an admin key's panes work
(usage by adapter, audit rows without their text) while an auditor's rows carry text."""

from __future__ import annotations

import shutil
import subprocess
import time
import uuid
from html import escape

import httpx
import pytest
from gateway_procs import free_port, start_gateway, stop

from lorapool.audit_db import AuditWriter, DatabaseConfig, WriterConfig, create_audit_engine
from lorapool.audit_db.database import migrate
from lorapool.lifecycle.keys import Keys
from lorapool.producer.api_keys import ApiKeys

pytestmark = pytest.mark.integration
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
OPENSSL = shutil.which("openssl")


@pytest.fixture(scope="module")
def keys(conn, prefix):
    store = ApiKeys(conn, Keys(prefix))
    made = {
        "audit": store.add("acme", "audit"),
        "admin": store.add("ops", "admin"),
        "submit": store.add("acme", "submit"),
        "doomed": store.add("acme", "audit"),
    }
    return {name: key for name, (_, key) in made.items()} | {"doomed-id": made["doomed"][0].id}


@pytest.fixture(scope="module")
def site(redis_url, prefix, worker, keys, conn, tmp_path_factory):
    """The gateway over TLS with an audit database holding one acme row."""
    if OPENSSL is None:
        pytest.skip("no openssl to make a certificate")
    tmp = tmp_path_factory.mktemp("tls")
    subprocess.run(
        [OPENSSL, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-keyout", str(tmp / "key.pem"), "-out", str(tmp / "cert.pem"),
         "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True,
    )  # fmt: skip
    db = f"sqlite:///{tmp / 'audit.sqlite'}"
    engine = create_audit_engine(DatabaseConfig(url=db))
    migrate(engine)
    port = free_port()
    proc = start_gateway(
        redis_url, prefix, port, tmp, "--audit-db-url", db, "--ssl-certfile",
        str(tmp / "cert.pem"), "--ssl-keyfile", str(tmp / "key.pem"), auth=True,
    )  # fmt: skip
    url = f"https://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None and time.monotonic() < deadline, "the gateway did not start"
        try:
            if httpx.get(f"{url}/readyz?min_workers=1", verify=False).status_code == 200:
                break
        except httpx.TransportError:
            time.sleep(0.2)
    body = {"model": "ad-qv", "prompt": "acme's question", "max_tokens": 8, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {keys['submit']}"}
    job = httpx.post(f"{url}/v1/jobs", json=body, headers=headers, verify=False).json()
    while (done := httpx.get(f"{url}/v1/jobs/{job['id']}", headers=headers, verify=False).json())[
        "status"
    ] in ("queued", "running"):
        time.sleep(0.1)
    time.sleep(0.5)
    AuditWriter(conn, engine, WriterConfig(prefix=prefix)).run(burst=True)
    text = done["result"]["outputs"][0]["text"]
    assert text.strip()
    keys["acme-text"] = escape(text[:200])  # as the page shows it: the completion's text
    yield url
    stop(proc)
    engine.dispose()


def _client(url: str, address: str = "127.0.0.1") -> httpx.Client:
    transport = httpx.HTTPTransport(local_address=address, verify=False)
    return httpx.Client(base_url=url, transport=transport, timeout=30, follow_redirects=False)


def _login(client: httpx.Client, key: str, origin: str | None) -> httpx.Response:
    headers = {} if origin is None else {"Origin": origin}
    return client.post("/dashboard/login", data={"key": key}, headers=headers)


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium (apt-get install chromium)")
def test_a_browser_session_is_a_signed_token_in_a_strict_cookie(site, keys):
    from playwright import sync_api

    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            context = browser.new_context(ignore_https_errors=True)
            page = context.new_page()
            evil = ('<form method="post" action="' + site + '/dashboard/login">'
                    f'<input name="key" value="{keys["audit"]}"></form>'
                    "<script>document.forms[0].submit()</script>")  # fmt: skip
            page.route("http://evil.example/**", lambda route: route.fulfill(
                body=evil, content_type="text/html"))  # fmt: skip
            with page.expect_navigation():
                page.goto("http://evil.example/")
            assert "may not post here" in page.content()  # the cross-origin login failed
            assert not [c for c in context.cookies() if c["name"] == "lorapool_session"]

            page.goto(f"{site}/dashboard?refresh=600")
            page.fill("input[name=key]", keys["audit"])
            started = time.time()
            page.click("button")
            page.wait_for_selector("#workers")
            [cookie] = [c for c in context.cookies() if c["name"] == "lorapool_session"]
            assert cookie["httpOnly"] and cookie["secure"] and cookie["sameSite"] == "Strict"
            assert 3500 < cookie["expires"] - started < 3700  # the session's hour
            assert keys["audit"] not in cookie["value"] and len(cookie["value"]) > 40
            assert all(keys["audit"] not in c["value"] for c in context.cookies())
            assert page.evaluate("document.cookie") == ""  # HttpOnly: no script reads it
            assert keys["acme-text"] in page.content()  # an auditor reads its rows

            page.click("form.logout button")
            page.wait_for_selector("input[name=key]")
            assert not [c for c in context.cookies() if c["name"] == "lorapool_session"]
            with _client(site) as client:  # and the old session is gone server-side
                page_after = client.get("/dashboard", cookies={"lorapool_session": cookie["value"]})
                assert page_after.status_code == 401
        finally:
            browser.close()


def test_login_refuses_what_it_should_and_throttles_wrong_tries(site, keys, conn, prefix):
    with _client(site, "127.0.0.5") as client:
        assert _login(client, keys["audit"], None).status_code == 403  # no Origin, no Referer
        assert _login(client, keys["audit"], "https://evil.example").status_code == 403
        assert _login(client, keys["submit"], site).status_code == 403  # role
        assert "set-cookie" not in _login(client, keys["submit"], site).headers
        ok = _login(client, keys["doomed"], site)
        assert ok.status_code == 303 and ok.headers["location"] == "/dashboard"
        session = ok.cookies["lorapool_session"]
        assert client.get("/dashboard", cookies={"lorapool_session": session}).status_code == 200
        stored = [k for k in conn.scan_iter(f"{prefix}:session:*")]
        assert stored and all(0 < conn.ttl(k) <= 3600 for k in stored)
        ApiKeys(conn, Keys(prefix)).revoke(keys["doomed-id"])  # a revoked key's session ends
        assert client.get("/dashboard", cookies={"lorapool_session": session}).status_code == 401
        token = session.partition(".")[0]
        forged = f"{token}.{'A' * 24}"
        assert client.get("/dashboard", cookies={"lorapool_session": forged}).status_code == 401
        raw_key = {"lorapool_dashboard_key": keys["audit"]}  # the old cookie: the key itself
        assert client.get("/dashboard", cookies=raw_key).status_code == 401

    with _client(site, "127.0.0.6") as client:
        answers = [_login(client, f"lp_{uuid.uuid4().hex[:16]}_x", site) for _ in range(14)]
        codes = [a.status_code for a in answers]
        assert codes[:6] == [401] * 6 and codes[-1] == 429, codes  # (the tries above: .5)
        assert int(answers[-1].headers["retry-after"]) >= 1
        assert _login(client, keys["audit"], site).status_code == 429  # even the right key
    with _client(site, "127.0.0.7") as other:  # another client is not throttled
        assert _login(other, keys["audit"], site).status_code == 303


def test_row14_an_admin_keys_panes_work_without_tenants_text(site, keys):
    with _client(site) as client:
        admin = client.get("/dashboard", headers={"Authorization": f"Bearer {keys['admin']}"})
        auditor = client.get("/dashboard", headers={"Authorization": f"Bearer {keys['audit']}"})
    assert admin.status_code == 200 and "failed" not in admin.text
    assert 'id="hottest"' in admin.text and "requests (15 min)" in admin.text
    assert "ad-qv" in admin.text and 'id="audit"' in admin.text
    assert keys["acme-text"] not in admin.text and "text (first 200)" not in admin.text
    assert keys["acme-text"] in auditor.text
    for pane in ('id="audit-backlog"', 'id="requests"', 'class="num kv"', 'id="webhook-dead"'):
        assert pane in admin.text, pane
