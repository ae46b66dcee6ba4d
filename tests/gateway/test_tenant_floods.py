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
