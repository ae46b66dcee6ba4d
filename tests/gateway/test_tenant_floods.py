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
import time

import httpx
import pytest
from gateway_procs import free_port, lorapool_cmd, stop, wait_answering

from lorapool.lifecycle.keys import Keys
from lorapool.openai.nesting import MAX_JSON_DEPTH
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


def _channels_once_settled(conn, prefix: str, timeout: float = 30.0) -> list:
    """The jobs' channels still subscribed once the gateway has noticed every disconnect:
    none within ``timeout`` (a loaded box takes seconds), else those left (the old code
    left one per disconnect, for good)."""
    deadline = time.monotonic() + timeout
    while (channels := conn.pubsub_channels(f"{prefix}:out:*")) and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(0.5)  # and the access log's lines are written
    return channels


# Row 6: leaving a waiting job-events stream
def test_row6_leaving_waiting_event_streams_is_quiet_and_the_gateway_serves_on(
    gateway, keys, conn, prefix
):
    """Each left stream ends with its read of the job (the stream's task did not: it
    still ran when the close of its generator failed), and logs no more than its
    access line."""
    url, log = gateway
    job = httpx.post(f"{url}/v1/jobs", json=JOB, headers=keys["acme"], timeout=30)
    assert job.status_code == 202, job.text
    events = f"{url}/v1/jobs/{job.json()['id']}/events"
    time.sleep(0.5)
    before = len(_lines(log))
    count = 50
    for _ in range(count):
        with httpx.stream("GET", events, headers=keys["acme"], timeout=30) as stream:
            assert stream.status_code == 200
            assert next(stream.iter_raw()).startswith(b"retry:")  # the stream waits now
    following = _channels_once_settled(conn, prefix)  # a live read of the job
    assert following == [], following
    lines = _lines(log)[before:]
    assert not [line for line in lines if "aclose" in line or "Traceback" in line], lines[:40]
    assert len(lines) <= count, lines[:40]  # the access log's line each, no more
    assert httpx.get(f"{url}/healthz", timeout=10).status_code == 200
    again = httpx.get(f"{url}/v1/jobs/{job.json()['id']}", headers=keys["acme"], timeout=10)
    assert again.status_code == 200 and again.json()["status"] == "queued", again.text


def test_row6_leaving_waiting_openai_streams_is_quiet_too(gateway, keys, conn, prefix):
    """The OpenAI streams wait for their first chunk the same way (``until_taken``)."""
    url, log = gateway
    before, count = len(_lines(log)), 20
    body = {**JOB, "stream": True}
    for _ in range(count):
        with httpx.stream(
            "POST", f"{url}/v1/completions", json=body, headers=keys["acme"], timeout=30
        ) as stream:
            assert stream.status_code == 200
    following = _channels_once_settled(conn, prefix)
    assert following == [], following
    lines = _lines(log)[before:]
    assert not [line for line in lines if "aclose" in line or "Traceback" in line], lines[:40]
    assert len(lines) <= count, lines[:40]
    assert httpx.get(f"{url}/healthz", timeout=10).status_code == 200


DEEP = 5000
DEEP_VALUE = "[" * DEEP + "]" * DEEP
MESSAGES = [{"role": "user", "content": "hi"}]
# every POST route that reads a JSON body, the deep value where its parser reads it
DEEP_BODIES = [
    ("/v1/completions", "acme", {**JOB, "structured_outputs": {"json": "@"}}),
    ("/v1/chat/completions", "acme", {"model": "ad-qv", "messages": MESSAGES, "tools": ["@"]}),
    ("/v1/jobs", "acme", {**JOB, "guided_json": {"a": "@"}}),
    ("/v1/jobs", "acme", {**JOB, "unknown": "@"}),
    (
        "/v1/batches",
        "acme",
        {"input_file_id": "file-x", "endpoint": "/v1/completions", "metadata": {"a": "@"}},
    ),  # fmt: skip
    ("/tokenize", "acme", {"model": "ad-qv", "messages": ["@"]}),
    ("/detokenize", "acme", {"tokens": [1], "extra": "@"}),
    ("/v1/load_lora_adapter", "ops", {"lora_name": "x", "lora_path": "/x", "lora_int_id": "@"}),
    ("/v1/unload_lora_adapter", "ops", {"lora_name": "x", "lora_int_id": "@"}),
]  # (/v1/lora_resolver reads 4 KB at most: 413 comes first)


# Row 10: a body nested 5,000 deep
@pytest.mark.parametrize(("path", "who", "body"), DEEP_BODIES)
def test_row10_a_deeply_nested_body_is_a_400_naming_the_nesting(gateway, keys, path, who, body):
    import orjson

    raw = orjson.dumps(body).replace(b'"@"', DEEP_VALUE.encode())
    headers = {**keys[who], "Content-Type": "application/json"}
    answer = httpx.post(f"{gateway[0]}{path}", content=raw, headers=headers, timeout=30)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["code"] == "json_too_deep", error
    assert f"deeper than {MAX_JSON_DEPTH} levels" in error["message"], error


def test_row10_a_body_at_the_nesting_limit_is_read(gateway, keys):
    deep = {"type": "object"}
    for _ in range((MAX_JSON_DEPTH - 4) // 2):  # two levels a schema level
        deep = {"type": "object", "properties": {"a": deep}}
    body = {**JOB, "structured_outputs": {"json": deep}}
    answer = httpx.post(f"{gateway[0]}/v1/jobs", json=body, headers=keys["acme"], timeout=30)
    assert answer.status_code != 500 and "json_too_deep" not in answer.text, answer.text


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
