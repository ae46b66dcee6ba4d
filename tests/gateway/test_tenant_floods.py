"""Issue 51 ("one tenant cannot take the service from the others"), rows 6, 10 and 11,
over a real ``lorapool serve`` with keys (no worker: every job stays queued, so an
events stream waits) whose log is kept: each row done as it was measured, and the
answer the issue asks for checked.

- row 6: leaving job-event streams that wait logged a traceback of ``aclose(): asynchronous
  generator is already running`` each (~148 lines), and left the stream's read running;
- row 10: a body nested 5,000 deep answered 500 ``internal_error`` on the POST routes;
- row 11: 11 prompts on an rpm=10 key answered 429 with Retry-After, though the request
  can never fit.
"""

from __future__ import annotations

import subprocess

import httpx
import pytest
from gateway_procs import free_port, lorapool_cmd, stop, wait_answering

from lorapool.lifecycle.keys import Keys
from lorapool.producer.api_keys import ApiKeys

pytestmark = pytest.mark.integration
JOB = {"model": "ad-qv", "prompt": "waits", "max_tokens": 3}


@pytest.fixture(scope="module")
def keys(conn, prefix):
    store = ApiKeys(conn, Keys(prefix))
    made = {"acme": store.add("acme", "submit"), "tight": store.add("tight", "submit", rpm=10)}
    made["ops"] = store.add("ops", "admin")
    return {name: {"Authorization": f"Bearer {key}"} for name, (_, key) in made.items()}


@pytest.fixture(scope="module")
def gateway(redis_url, prefix, registry, tmp_path_factory):
    """(URL, log path) of a gateway with keys at its default log level (info), its
    output kept; adapter administration on (its routes read bodies too)."""
    cwd = tmp_path_factory.mktemp("gateway")
    log = cwd / "gateway.log"
    port = free_port()
    cmd = lorapool_cmd(
        "serve", "--port", str(port), "--prefix", prefix, "--redis-url", redis_url,
        "--enable-adapter-admin",
    )  # fmt: skip
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_answering(proc, f"{url}/healthz", "the gateway")
    yield url, log
    stop(proc)


def _lines(log) -> list[str]:
    return log.read_text(errors="replace").splitlines()


# Row 11: more prompts in one request than the key's requests a minute
def test_row11_a_request_over_the_whole_rpm_is_a_400_without_retry_after(gateway, keys):
    url = gateway[0]
    body = {**JOB, "prompt": ["p"] * 11}
    answer = httpx.post(f"{url}/v1/completions", json=body, headers=keys["tight"], timeout=30)
    assert answer.status_code == 400, answer.text
    assert "retry-after" not in answer.headers
    error = answer.json()["error"]
    assert error["param"] == "prompt" and error["code"] == "exceeds_rate_limit", error
    assert "never fit" in error["message"] and "10 requests per minute" in error["message"]
