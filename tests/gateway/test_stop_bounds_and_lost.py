"""Issue 31, Build 6 (stop bounds) and Build 5's gateway half (JobLost answered).

A gateway with no worker: stop lists past the gateway's ``max_stop`` (4, OpenAI's, by
default) or past SamplingParams' own bounds are refused at the door with a 400 on
``stop`` (httpx and the official openai client); the same bounds hold for Python
producers. A job whose marker and log vanish from Redis (a restart without
persistence, a FLUSHDB) is answered within seconds: a 503 ``job_lost`` for a waiting
call, an error event that ends an open stream.
"""

from __future__ import annotations

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
        (["z" * 100] * 1000, f"at most {MAX_STOP} strings"),
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
        (["s"] * (MAX_STOP + 1), f"sampling_params.stop must hold at most {MAX_STOP} strings"),
        (["x" * (MAX_STOP_CHARS + 1)], f"sampling_params.stop[0] must be at most {MAX_STOP_CHARS}"),
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
