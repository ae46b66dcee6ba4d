"""Turns at the gateway's work, by tenant (``gateway/turns.py``; issue 51's hostile-tenant
bench: one tenant's flood kept the event loop busy and another's 15 ms call took 8.5x),
over a real ``lorapool serve`` with keys and ``--turns-per-tenant 1`` (no worker: every
job stays queued):

- a tenant whose turn is held (a body it sends slowly) waits with its next request,
  before its body is read, while another tenant is served at once; its request goes in
  when the turn comes back (the slow body cut at its deadline);
- a completion waiting for its tokens and an open job-events stream hold no turn: the
  same tenant's next submit is answered at once;
- nor does a file upload whose body comes slowly (bounded by its hold, holds.py): a web
  app's one key is not stuck behind one of its users' uploads.
"""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest
from gateway_procs import serve_logged, stop

from lorapool.lifecycle.keys import Keys
from lorapool.producer.api_keys import ApiKeys

pytestmark = pytest.mark.integration
JOB = {"model": "ad-qv", "prompt": "waits", "max_tokens": 3}
BODY_TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def keys(conn, prefix):
    store = ApiKeys(conn, Keys(prefix))
    made = {name: store.add(name, "submit") for name in ("acme", "globex")}
    return {name: {"Authorization": f"Bearer {key}"} for name, (_, key) in made.items()}


@pytest.fixture(scope="module")
def gateway(redis_url, prefix, registry, tmp_path_factory):
    url, proc, _ = serve_logged(
        redis_url, prefix, tmp_path_factory.mktemp("gateway"),
        "--queue-timeout", "120", "--turns-per-tenant", "1",
        env={"LORAPOOL_BODY_TIMEOUT": str(BODY_TIMEOUT_S)},
    )  # fmt: skip
    yield url
    stop(proc)


def _hold_turn(
    url: str, headers: dict, path="/v1/jobs", kind="application/json", first=b"{"
) -> socket.socket:
    """POST ``path`` with its headers and the first bytes of its body: its handler has
    taken the tenant's turn and reads the body until the deadline cuts it."""
    port = int(url.rsplit(":", 1)[1])
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    head = (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: {kind}\r\n"
        f"Authorization: {headers['Authorization']}\r\nContent-Length: 1000\r\n\r\n"
    )
    sock.sendall(head.encode() + first)
    return sock


def _timed_post(url: str, headers: dict, out: dict, name: str, start: float) -> None:
    answer = httpx.post(f"{url}/v1/jobs", json=JOB, headers=headers, timeout=30)
    out[name] = (time.monotonic() - start, answer.status_code, answer.text)


def test_a_tenants_next_request_waits_for_its_turn_while_another_tenant_is_served(gateway, keys):
    url = gateway
    for who in ("acme", "globex"):  # warm: each key known to the gateway
        httpx.post(f"{url}/v1/jobs", json=JOB, headers=keys[who], timeout=30)
    start = time.monotonic()
    holder = _hold_turn(url, keys["acme"])
    time.sleep(0.3)  # its handler has the turn and waits for the body
    out: dict = {}
    waiter = threading.Thread(target=_timed_post, args=(url, keys["acme"], out, "acme", start))
    waiter.start()
    time.sleep(0.3)
    _timed_post(url, keys["globex"], out, "globex", start)
    waiter.join()
    holder.settimeout(10)
    cut = holder.recv(4096)
    holder.close()
    assert cut.startswith(b"HTTP/1.1 408"), cut[:200]
    globex_s, globex_status, text = out["globex"]
    acme_s, acme_status, acme_text = out["acme"]
    assert globex_status == 202, text
    assert acme_status == 202, acme_text
    assert globex_s < BODY_TIMEOUT_S - 0.5, out  # not behind acme's turn
    assert acme_s > BODY_TIMEOUT_S - 0.2, out  # went in once the slow body was cut


def test_a_waiting_completion_and_an_open_stream_hold_no_turn(gateway, keys):
    url, acme = gateway, keys["acme"]
    job = httpx.post(f"{url}/v1/jobs", json=JOB, headers=acme, timeout=30).json()
    done: dict = {}

    def complete():  # waits for tokens no worker will make
        try:
            httpx.post(f"{url}/v1/completions", json=JOB, headers=acme, timeout=8)
        except httpx.TimeoutException:
            done["timed_out"] = True

    events_url = f"{url}/v1/jobs/{job['id']}/events"
    with (
        httpx.Client(timeout=30) as client,
        client.stream("GET", events_url, headers=acme) as events,
    ):
        assert events.status_code == 200
        waiting = threading.Thread(target=complete)
        waiting.start()
        time.sleep(1.0)
        began = time.monotonic()
        answer = httpx.post(f"{url}/v1/jobs", json=JOB, headers=acme, timeout=30)
        took = time.monotonic() - began
        assert answer.status_code == 202, answer.text
        assert took < 1.5, took
        waiting.join()
    assert done.get("timed_out")  # the completion was still waiting all along


def test_a_slow_upload_holds_no_turn(gateway, keys):
    """An upload's body, read under its hold, keeps the key's turn free: the same key's
    submit is answered at once, not after the upload is cut (``BODY_TIMEOUT_S``)."""
    url, acme = gateway, keys["acme"]
    part = (
        b'--b\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n--b\r\n'
        b'Content-Disposition: form-data; name="file"; filename="in.jsonl"\r\n\r\n{'
    )
    upload = _hold_turn(url, acme, "/v1/files", "multipart/form-data; boundary=b", part)
    time.sleep(0.5)  # its handler holds its hold and reads the form
    began = time.monotonic()
    answer = httpx.post(f"{url}/v1/jobs", json=JOB, headers=acme, timeout=30)
    took = time.monotonic() - began
    upload.settimeout(10)
    cut = upload.recv(4096)
    upload.close()
    assert answer.status_code == 202, answer.text
    assert cut.startswith(b"HTTP/1.1 408"), cut[:200]  # the upload was still being read
    assert took < BODY_TIMEOUT_S - 1.0, took
