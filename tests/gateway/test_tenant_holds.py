"""Issue 51 ("one tenant cannot take the service from the others"), rows 5 and 7, over
a real ``lorapool serve`` with keys (no worker: every job stays queued, so its events
stream and a streamed completion wait):

- row 5: 6,000 held job-event streams from 24 addresses (the cap of 256 is per
  address) took the gateway's memory and every other tenant's latency. Scaled down
  here: caps of 3 streams a tenant and 5 in all (``--max-streams-per-tenant``,
  ``--max-streams``); one tenant at its cap gets 429 naming the cap on every long-lived
  kind while another tenant still connects and is served, the gateway's total gets
  503, and a hold comes back when its stream ends;
- row 7: request bodies sent a byte every 2 s were all still open 40 s later. Here,
  with ``--body-timeout 2``: each is answered 408 and closed within the deadline and a
  little, while a normal client and a large body sent at a fair rate are served.

The caps and deadlines are given by their environment variables (``LORAPOOL_...``,
as a deployment may): a gateway without them starts all the same, and shows the old
behaviour.
"""

from __future__ import annotations

import os
import socket
import subprocess
import threading
import time

import httpx
import orjson
import pytest
from gateway_procs import free_port, lorapool_cmd, serve_logged, stop, wait_answering

from lorapool.lifecycle.keys import Keys
from lorapool.producer.api_keys import ApiKeys

pytestmark = pytest.mark.integration
JOB = {"model": "ad-qv", "prompt": "waits", "max_tokens": 3}
PER_TENANT, TOTAL, BODY_TIMEOUT_S = 3, 5, 2.0


@pytest.fixture(scope="module")
def keys(conn, prefix):
    store = ApiKeys(conn, Keys(prefix))
    made = {name: store.add(name, "submit") for name in ("acme", "globex", "initech")}
    return {name: {"Authorization": f"Bearer {key}"} for name, (_, key) in made.items()}


@pytest.fixture(scope="module")
def gateway(redis_url, prefix, registry, tmp_path_factory):
    env = {
        "LORAPOOL_MAX_STREAMS_PER_TENANT": str(PER_TENANT),
        "LORAPOOL_MAX_STREAMS": str(TOTAL),
        "LORAPOOL_BODY_TIMEOUT": str(BODY_TIMEOUT_S),
    }
    cwd = tmp_path_factory.mktemp("gateway")
    url, proc, log = serve_logged(redis_url, prefix, cwd, "--queue-timeout", "120", env=env)
    yield url, log
    stop(proc)


class Held:
    """Streams held open; each read to its first bytes (the answer has begun)."""

    def __init__(self):
        self.clients: list[httpx.Client] = []
        self.open: list = []

    def stream(self, method: str, url: str, headers: dict, **kw) -> httpx.Response:
        client = httpx.Client(timeout=30)
        context = client.stream(method, url, headers=headers, **kw)
        response = context.__enter__()
        if response.status_code == 200:
            reading = response.iter_raw()
            next(reading)  # the stream has begun (and holds)
            self.clients.append(client)
            self.open.append((context, reading))  # (a dropped reader closes its stream)
        else:
            response.read()
            context.__exit__(None, None, None)
            client.close()
        return response

    def close(self) -> None:
        for (context, _reading), client in zip(self.open, self.clients):
            context.__exit__(None, None, None)
            client.close()
        self.open, self.clients = [], []


def _job(url: str, who: dict) -> str:
    answer = httpx.post(f"{url}/v1/jobs", json=JOB, headers=who, timeout=30)
    assert answer.status_code == 202, answer.text
    return answer.json()["id"]


def _refused(answer: httpx.Response, status: int, cap: str) -> None:
    assert answer.status_code == status, answer.status_code
    error = answer.json()["error"]
    assert error["code"] == "too_many_streams" and cap in error["message"], error
    assert answer.headers.get("retry-after") == "1"


def _requests(conn, prefix: str) -> int:
    return conn.xlen(Keys(prefix).requests)


# Row 5: streams held by one tenant, and by all
def test_row5_a_tenant_at_its_cap_gets_429_while_another_is_served(gateway, keys, conn, prefix):
    url, log = gateway
    acme, globex, initech = keys["acme"], keys["globex"], keys["initech"]
    events = f"{url}/v1/jobs/{_job(url, acme)}/events"
    files = {"file": ("in.jsonl", b'{"custom_id": "a"}\n')}
    made = httpx.post(
        f"{url}/v1/files", files=files, data={"purpose": "batch"}, headers=acme, timeout=30
    )
    assert made.status_code == 200, made.text
    held = Held()
    try:
        for _ in range(PER_TENANT):
            assert held.stream("GET", events, acme).status_code == 200
        # every long-lived kind of the tenant's is refused, naming the cap; no job made
        _refused(held.stream("GET", events, acme), 429, "--max-streams-per-tenant")
        queued = _requests(conn, prefix)
        body = {**JOB, "stream": True}
        completion = held.stream("POST", f"{url}/v1/completions", acme, json=body)
        _refused(completion, 429, "--max-streams-per-tenant")
        assert _requests(conn, prefix) == queued  # refused before its job was submitted
        files = {"file": ("in.jsonl", b"{}\n")}
        upload = httpx.post(
            f"{url}/v1/files", files=files, data={"purpose": "batch"}, headers=acme, timeout=30
        )
        _refused(upload, 429, "--max-streams-per-tenant")
        content = f"{url}/v1/files/{made.json()['id']}/content"
        _refused(httpx.get(content, headers=acme, timeout=30), 429, "--max-streams-per-tenant")
        # its other calls go on, and another tenant connects and is served
        assert httpx.get(events.removesuffix("/events"), headers=acme).status_code == 200
        other = f"{url}/v1/jobs/{_job(url, globex)}/events"
        assert held.stream("GET", other, globex).status_code == 200
        chat = {"model": "ad-qv", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        answer = held.stream("POST", f"{url}/v1/chat/completions", globex, json=chat)
        assert answer.status_code == 200, answer.status_code
        # now 5 are held: the gateway's cap, for a third tenant too
        third = f"{url}/v1/jobs/{_job(url, initech)}/events"
        _refused(held.stream("GET", third, initech), 503, "--max-streams")
    finally:
        held.close()
    # the holds come back as their streams end, and as uploads left half-way end (quietly)
    before = len(log.read_text(errors="replace").splitlines())
    _abandon_uploads(url, acme, PER_TENANT + 2)
    lines = log.read_text(errors="replace").splitlines()[before:]
    assert not [line for line in lines if "Traceback" in line or "ERROR" in line], lines[:40]
    deadline = time.monotonic() + 30
    while (again := held.stream("GET", events, acme)).status_code != 200:
        assert time.monotonic() < deadline, again.status_code
        time.sleep(0.2)
    try:
        for _ in range(PER_TENANT - 1):
            assert held.stream("GET", events, acme).status_code == 200
        _refused(held.stream("GET", events, acme), 429, "--max-streams-per-tenant")
    finally:
        held.close()


# Row 7: a body sent a byte at a time
def _drip(port: int, key: str, result: dict, index: int, every_s: float = 0.5) -> None:
    """POST /v1/jobs with a valid key (its handler reads the body) declaring 1,000
    bytes and sending one every ``every_s``; records when the server answered or closed
    (None: still open after 20 s) and what it said."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    head = (
        f"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Authorization: {key}\r\nContent-Length: 1000\r\n\r\n"
    )
    sock.sendall(head.encode())
    start, received = time.monotonic(), b""
    sock.settimeout(every_s)
    try:
        while time.monotonic() - start < 20:
            try:
                sock.sendall(b" ")
            except OSError:
                break
            try:
                part = sock.recv(4096)
            except TimeoutError:
                continue
            except OSError:
                break
            if not part:
                break
            received += part
    finally:
        elapsed = time.monotonic() - start
        result[index] = (elapsed if elapsed < 20 else None, received)
        sock.close()


def test_row7_dripped_bodies_are_cut_at_the_deadline_and_others_are_served(gateway, keys):
    url, log = gateway
    before = len(log.read_text(errors="replace").splitlines())
    port = int(url.rsplit(":", 1)[1])
    count, result = 20, {}
    key = keys["initech"]["Authorization"]
    threads = [threading.Thread(target=_drip, args=(port, key, result, i)) for i in range(count)]
    for thread in threads:
        thread.start()
    time.sleep(0.5)
    # meanwhile a normal client is served, and a 24 KB body sent over ~3 s (a fair rate:
    # the deadline grows a second for every 500 bytes) is not cut
    served = httpx.post(f"{url}/v1/jobs", json=JOB, headers=keys["globex"], timeout=30)
    assert served.status_code == 202, served.text
    big = b" " * 24_000 + orjson.dumps(JOB)  # JSON may begin with whitespace

    def slowly():
        for i in range(0, len(big), len(big) // 6):
            yield big[i : i + len(big) // 6]
            time.sleep(0.5)

    headers = {**keys["globex"], "Content-Type": "application/json"}
    fair = httpx.post(f"{url}/v1/jobs", content=slowly(), headers=headers, timeout=30)
    assert fair.status_code == 202, fair.text
    for thread in threads:
        thread.join()
    cut = [elapsed for elapsed, _ in result.values() if elapsed is not None]
    assert len(cut) == count, result  # none still open
    assert max(cut) < BODY_TIMEOUT_S + 3, sorted(cut)
    for _elapsed, received in result.values():
        assert received.startswith(b"HTTP/1.1 408"), received[:200]
        assert b"did not arrive within 2s" in received, received
    assert httpx.get(f"{url}/healthz", timeout=10).status_code == 200
    lines = log.read_text(errors="replace").splitlines()[before:]
    assert not [line for line in lines if "Traceback" in line or "ERROR" in line], lines[:40]


def _abandon_uploads(url: str, who: dict, count: int) -> None:
    """Uploads left half-way: the form's first bytes, then the connection closed."""
    port = int(url.rsplit(":", 1)[1])
    part = b'--x\r\nContent-Disposition: form-data; name="file"; filename="a.jsonl"\r\n\r\n{}'
    for _ in range(count):
        sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        head = (
            f"POST /v1/files HTTP/1.1\r\nHost: x\r\n{_auth(who)}"
            "Content-Type: multipart/form-data; boundary=x\r\nContent-Length: 100000\r\n\r\n"
        )
        sock.sendall(head.encode() + part)
        time.sleep(0.3)  # its handler reads the form now
        sock.close()
    time.sleep(1.0)


def _auth(headers: dict) -> str:
    return f"Authorization: {headers['Authorization']}\r\n"


def test_connections_past_the_gateways_total_get_503(redis_url, prefix, tmp_path):
    """``--max-connections`` (here 4, by ``$LORAPOOL_MAX_CONNECTIONS``): idle connections
    from anywhere count; the next one is answered 503 and closed, and once one closes
    a new one is served."""
    port = free_port()
    cmd = lorapool_cmd("serve", "--port", str(port), "--prefix", prefix, "--redis-url", redis_url)
    env = {**os.environ, "LORAPOOL_MAX_CONNECTIONS": "4"}
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_answering(proc, f"{url}/healthz", "the gateway")
        time.sleep(0.5)  # the readiness probe's connection has closed
        idle = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(4)]
        try:
            time.sleep(0.3)
            answer = httpx.get(f"{url}/healthz", timeout=10)
            assert answer.status_code == 503, answer.text
            assert "over 4 connections to this gateway" in answer.json()["error"]["message"]
        finally:
            for sock in idle:
                sock.close()
        time.sleep(0.3)
        assert httpx.get(f"{url}/healthz", timeout=10).status_code == 200
    finally:
        stop(proc)
