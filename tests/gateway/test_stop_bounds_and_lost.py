"""Issue 31, Build 6 (stop bounds) and Build 5's gateway half (JobLost answered).

A gateway with no worker: stop lists past the gateway's ``max_stop`` (4, OpenAI's, by
default) or past SamplingParams' own bounds are refused at the door with a 400 on
``stop`` (httpx and the official openai client); the same bounds hold for Python
producers. A job whose marker and log vanish from Redis (a restart without
persistence, a FLUSHDB) is answered within seconds: a 503 ``job_lost`` for a waiting
call, an error event that ends an open stream.
"""

from __future__ import annotations

import threading
import time
import uuid

import httpx
import openai
import orjson
import pytest
from gateway_procs import serve, stop

from lorapool.lifecycle.keys import Keys
from lorapool.producer import Producer
from lorapool.protocol import (
    MAX_STOP,
    MAX_STOP_CHARS,
    MAX_STOP_TOTAL_CHARS,
    FieldError,
    SamplingParams,
)

BASE = "stop-bounds-base"


@pytest.fixture(scope="module")
def pool(redis_url, conn, tmp_path_factory):
    """A gateway (no worker) whose base model is named in Redis as a worker would."""
    prefix = f"test-stop-{uuid.uuid4().hex[:8]}"
    conn.set(Keys(prefix).model, orjson.dumps({"name": BASE, "sha256": "0" * 64}))
    url, proc = serve(redis_url, prefix, tmp_path_factory.mktemp("gw"))
    yield {"url": url, "prefix": prefix}
    stop(proc)
    for key in conn.scan_iter(f"{prefix}:*"):
        conn.delete(key)


def _post(url: str, route: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/v1/{route}", json=body, timeout=30)


TOO_MANY = ["a", "b", "c", "d", "e"]


@pytest.mark.parametrize(
    ("stop_", "says"),
    [
        (TOO_MANY, "at most 4 strings"),
        (["x" * (MAX_STOP_CHARS + 1)], f"at most {MAX_STOP_CHARS} characters"),
        # (the 20 MB list is over the body limit here: 413; see the Python API test)
        (["z" * 100] * 1000, f"at most {MAX_STOP} non-empty strings"),
    ],
    ids=["five", "long-string", "1000"],
)
@pytest.mark.parametrize("route", ["completions", "chat/completions", "jobs"])
def test_stop_over_its_bounds_is_a_400_on_stop(pool, route, stop_, says):
    body = {"model": BASE, "max_tokens": 4, "stop": stop_}
    body |= (
        {"messages": [{"role": "user", "content": "hi"}]} if "chat" in route else {"prompt": "hi"}
    )
    response = _post(pool["url"], route, body)
    assert response.status_code == 400, response.text[:300]
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "stop"
    assert says in error["message"], error["message"]


def test_the_openai_client_meets_the_bound(pool):
    client = openai.OpenAI(base_url=f"{pool['url']}/v1", api_key="x", max_retries=0, timeout=30)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=BASE, prompt="hi", max_tokens=4, stop=TOO_MANY)
    assert info.value.body["param"] == "stop" and "at most 4" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=BASE, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
            stop=["s" * (MAX_STOP_CHARS + 1)],
        )  # fmt: skip
    assert info.value.body["param"] == "stop"


def test_max_stop_is_an_option(redis_url, pool, tmp_path):
    """``--max-stop 8`` takes 8 stop strings (and refuses 9) on the same pool."""
    url, proc = serve(redis_url, pool["prefix"], tmp_path, "--max-stop", "8")
    try:
        body = {"model": BASE, "prompt": "hi", "max_tokens": 4, "stop": ["s"] * 9}
        response = _post(url, "jobs", body)
        assert response.status_code == 400 and "at most 8" in response.json()["error"]["message"]
        response = _post(url, "jobs", {**body, "stop": ["s"] * 8})
        assert response.status_code in (200, 201, 202), response.text[:300]
    finally:
        stop(proc)


def test_python_api_bounds(conn):
    ok = SamplingParams(stop=["s"] * MAX_STOP)
    assert len(ok.stop) == MAX_STOP
    SamplingParams(stop=["x" * MAX_STOP_CHARS] * (MAX_STOP_TOTAL_CHARS // MAX_STOP_CHARS))
    for bad, says in [
        (
            ["s"] * (MAX_STOP + 1),
            f"sampling_params.stop must be a list of at most {MAX_STOP} strings",
        ),
        (
            ["x" * (MAX_STOP_CHARS + 1)],
            f"sampling_params.stop[0] must be a non-empty string of at most {MAX_STOP_CHARS} "
            "characters",
        ),
        (["x" * MAX_STOP_CHARS] * 9, f"at most {MAX_STOP_TOTAL_CHARS} characters in all"),
        (["z" * 1024] * 20_000, "at most 64 strings"),
    ]:
        with pytest.raises(FieldError, match=r"sampling_params\.stop") as info:
            SamplingParams(stop=bad)
        assert says in str(info.value)
    # changed after construction: the producer's submit checks again, nothing is queued
    prefix = f"test-stop-py-{uuid.uuid4().hex[:8]}"
    producer = Producer(conn, prefix=prefix)
    params = SamplingParams()
    params.stop = ["s"] * (MAX_STOP + 1)
    with pytest.raises(FieldError, match="at most 64 strings"):
        producer.submit("hi", params)
    assert not list(conn.scan_iter(f"{prefix}:*job*"))
    for key in conn.scan_iter(f"{prefix}:*"):
        conn.delete(key)


# --- Build 5: JobLost at the gateway -------------------------------------------------

LOST_WITHIN_S = 6.0  # the follower polls a queued job's log at 1, 2, 4 s... (MAX_QUIET_S 8)


def _lose_jobs(conn, prefix: str, known: set[bytes]) -> int:
    """Delete the markers of jobs not in ``known`` (and any log), as a Redis restarted
    without persistence would lose them: the number deleted."""
    keys = Keys(prefix)
    lost = 0
    for key in conn.scan_iter(keys.job("*")):
        if key not in known:
            lost += conn.delete(key)
    for key in conn.scan_iter(keys.out("*")):
        lost += conn.delete(key)
    return lost


def _markers(conn, prefix: str) -> set[bytes]:
    return set(conn.scan_iter(Keys(prefix).job("*")))


def _wait_submitted(conn, prefix: str, before: set[bytes], timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not _markers(conn, prefix) - before:
        assert time.monotonic() < deadline, "the gateway did not submit the job"
        time.sleep(0.05)


@pytest.mark.parametrize("route", ["completions", "chat/completions"])
def test_a_lost_job_is_a_prompt_503(pool, conn, route):
    """No worker: the job waits; its marker vanishes; the waiting call gets a 503
    job_lost within seconds, not at result_timeout_s (600 s) or queue_timeout_s (300 s)."""
    before = _markers(conn, pool["prefix"])
    body = {"model": BASE, "max_tokens": 4}
    body |= (
        {"messages": [{"role": "user", "content": "hi"}]} if "chat" in route else {"prompt": "hi"}
    )
    answer: dict = {}
    call = threading.Thread(target=lambda: answer.update(r=_post(pool["url"], route, body)))
    call.start()
    _wait_submitted(conn, pool["prefix"], before)
    time.sleep(0.5)
    assert _lose_jobs(conn, pool["prefix"], before) >= 1
    lost_at = time.monotonic()
    call.join(timeout=30)
    took = time.monotonic() - lost_at
    assert not call.is_alive(), "the call still waits 30 s after its job was lost"
    response = answer["r"]
    assert response.status_code == 503, response.text[:300]
    error = response.json()["error"]
    assert error["code"] == "job_lost" and error["type"] == "service_unavailable"
    assert "lost" in error["message"] and "again" in error["message"], error["message"]
    print(f"lost-job answer took {took:.2f} s")
    assert took < LOST_WITHIN_S, took


def test_a_lost_job_ends_its_stream_with_an_error_event(pool, conn):
    before = _markers(conn, pool["prefix"])
    client = openai.OpenAI(base_url=f"{pool['url']}/v1", api_key="x", max_retries=0, timeout=30)
    stream = client.chat.completions.create(
        model=BASE, messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True
    )
    _wait_submitted(conn, pool["prefix"], before)
    time.sleep(0.5)
    assert _lose_jobs(conn, pool["prefix"], before) >= 1
    lost_at = time.monotonic()
    with pytest.raises(openai.APIError) as info:
        for _ in stream:
            pass
    took = time.monotonic() - lost_at
    assert "lost" in str(info.value.message), info.value.message
    print(f"lost-job answer took {took:.2f} s")
    assert took < LOST_WITHIN_S, took


def test_a_lost_job_ends_its_raw_stream_and_job_routes(pool, conn):
    """The raw SSE of /v1/completions: an error event then [DONE]; /v1/jobs/{id}/events:
    an error event; GET /v1/jobs/{id} of a lost job: 404 (nothing is left of it)."""
    before = _markers(conn, pool["prefix"])
    body = {"model": BASE, "prompt": "hi", "max_tokens": 4, "stream": True}
    with httpx.stream("POST", f"{pool['url']}/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        _wait_submitted(conn, pool["prefix"], before)
        time.sleep(0.5)
        assert _lose_jobs(conn, pool["prefix"], before) >= 1
        lost_at = time.monotonic()
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    took = time.monotonic() - lost_at
    assert events[-1] == "data: [DONE]"
    error = orjson.loads(events[-2].removeprefix("data: "))["error"]
    assert error["code"] == "job_lost" and error["type"] == "service_unavailable"
    print(f"lost-job answer took {took:.2f} s")
    assert took < LOST_WITHIN_S, took

    job = _post(pool["url"], "jobs", {"model": BASE, "prompt": "hi", "max_tokens": 4}).json()
    before = set()  # every marker may go now
    with httpx.stream("GET", f"{pool['url']}/v1/jobs/{job['id']}/events", timeout=30) as r:
        assert r.status_code == 200
        time.sleep(0.5)
        assert _lose_jobs(conn, pool["prefix"], before) >= 1
        lost_at = time.monotonic()
        lines = list(r.iter_lines())
    took = time.monotonic() - lost_at
    assert "event: error" in lines, lines
    data = [line for line in lines if line.startswith("data: ")]
    error = orjson.loads(data[-1].removeprefix("data: "))
    assert error["code"] == "job_lost" and job["id"] in error["message"], error
    print(f"lost-job answer took {took:.2f} s")
    assert took < LOST_WITHIN_S, took
    assert httpx.get(f"{pool['url']}/v1/jobs/{job['id']}", timeout=10).status_code == 404
