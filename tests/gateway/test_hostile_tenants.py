"""Issue 32's hostile tenant, over real processes: two gateways with keys, a worker, the
audit writer and RQ workers delivering webhooks to receivers on loopback addresses of
this process. Each test reproduces a row of the issue's table as it was done, and
checks the answer Build asks for. (Rows 5 and 6, which pause Redis or drive a browser,
and row 7, CSV exports, live in test_redis_stall.py, test_dashboard_sessions.py and
test_audit_exports.py.)

The operator allows one internal range for receivers, ``127.0.0.40/30``; everything
else inward is refused. ``inward.example`` resolves to 127.0.0.1 through the egress
module's test resolver hook (tests/conftest.py)."""

from __future__ import annotations

import math
import statistics
import time

import httpx
import orjson
import pytest
import standardwebhooks
from gateway_procs import stop
from hostile_pool import (
    INWARD,
    JOB,
    LIMITS,
    auth,
    drip_until_answered,
    finished,
    hostile_requests,
    openai_error,
    post,
    routes_of,
    slowloris,
    start_deliveries,
    start_gateways,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from receivers import Receiver

from lorapool.batch.webhook_secrets import WebhookSecrets
from lorapool.lifecycle.keys import Keys
from lorapool.producer.api_keys import ApiKeys

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def keys(conn, prefix):
    store, secrets = ApiKeys(conn, Keys(prefix)), WebhookSecrets(conn, Keys(prefix))
    made = {
        "acme": store.add("acme", "submit"),
        "globex": store.add("globex", "submit"),
        "ops": store.add("ops", "admin"),
        "tight": store.add("tight", "submit", rpm=10),
        "batcher": store.add("batcher", "submit", rpm=30),
    }
    keys = {name: key for name, (_, key) in made.items()}
    keys["acme-id"] = made["acme"][0].id
    keys["secret-acme"] = secrets.current("acme")
    keys["secret-globex"] = secrets.current("globex")
    return keys


@pytest.fixture(scope="module")
def gateways(redis_url, prefix, worker, keys, tmp_path_factory):
    """Two gateways of the pool (auth on, one internal receiver range allowed); the
    second with a 2 s header deadline and 50 connections a client."""
    urls, procs = start_gateways(redis_url, prefix, tmp_path_factory)
    yield urls
    for proc in procs:
        stop(proc)


@pytest.fixture(scope="module")
def deliveries(redis_url, prefix, conn, tmp_path_factory):
    """The audit writer (dispatching webhooks: 2 s attempts, 2 attempts) and two RQ
    workers of the callback and batch queues."""
    procs = start_deliveries(redis_url, prefix, tmp_path_factory.mktemp("dispatch"))
    yield
    for proc in procs:
        stop(proc)
    conn.srem("rq:queues", f"rq:queue:{prefix}", f"rq:queue:{prefix}-batch")
    for key in conn.scan_iter(f"rq:*{prefix}*"):
        conn.delete(key)


# Row 1: webhooks aimed inward
@pytest.mark.parametrize("hook", INWARD)
def test_row1_a_webhook_aimed_inward_is_refused_at_submit(gateways, keys, hook):
    for url in gateways:
        error = openai_error(post(url, "/v1/jobs", {**JOB, "on_finish": hook}, keys), 400)
        assert error["param"] == "on_finish" and "refused" in error["message"]


def test_row1_a_redirect_inward_is_not_followed_and_the_allowed_receiver_gets_its_delivery(
    gateways, keys, conn, prefix, deliveries
):
    internal = Receiver(host="127.0.0.1")  # an internal service the redirect aims at
    bouncer = Receiver(f"redirect:http://127.0.0.1:{internal.port}/internal", host="127.0.0.41")
    allowed = Receiver(host="127.0.0.42")
    with internal, bouncer, allowed:
        bounced = post(gateways[0], "/v1/jobs", {**JOB, "on_finish": bouncer.url}, keys)
        good = post(gateways[1], "/v1/jobs", {**JOB, "on_finish": allowed.url}, keys)
        assert bounced.status_code == good.status_code == 202, (bounced.text, good.text)
        [hit] = allowed.wait_for(1, timeout=60)
        assert len(bouncer.wait_for(2, timeout=60)) == 2  # tried twice, then dead-lettered
        time.sleep(1)
    assert internal.hits == []
    event = standardwebhooks.Webhook(keys["secret-acme"]).verify(hit.body, hit.headers)
    assert event["data"]["id"] == good.json()["id"]
    with pytest.raises(standardwebhooks.webhooks.WebhookVerificationError):
        standardwebhooks.Webhook(keys["secret-globex"]).verify(hit.body, hit.headers)
    dead = [f for _, f in conn.xrange(f"{prefix}:webhook:dead")]
    assert any(b"redirects are not followed" in f[b"reason"] for f in dead), dead


# Row 2: a receiver that drips
def test_row2_a_dripping_receiver_delays_only_its_own_tenant(gateways, keys, deliveries):
    with Receiver("drip", host="127.0.0.43", drip_s=1.0) as drip, Receiver(host="127.0.0.42") as ok:
        for _ in range(3):
            post(gateways[0], "/v1/jobs", {**JOB, "on_finish": drip.url}, keys, "globex")
        drip.wait_for(1, timeout=60)
        start = time.time()
        job = post(gateways[1], "/v1/jobs", {**JOB, "on_finish": ok.url}, keys).json()
        done = finished(gateways[1], job["id"], keys)
        [hit] = ok.wait_for(1, timeout=30)
    assert done["status"] == "finished"
    assert hit.at - start < 8, f"acme's callback took {hit.at - start:.1f}s behind globex's drip"


# Row 3: batches count against the key's limits
def test_row3_a_key_at_its_rpm_gets_its_batch_lines_at_that_rate(
    gateways, keys, conn, prefix, deliveries
):
    """``--rpm 30`` (one request every 2 s after a burst of 30): at the limit, the upload
    is refused (429); once allowed, the batch's 30 lines go at the key's pace, not at
    once, and they spend the key's budget (its own jobs get 429 meanwhile)."""
    answers = [post(gateways[i % 2], "/v1/jobs", JOB, keys, "batcher") for i in range(30)]
    lines = b"".join(
        orjson.dumps({"custom_id": f"l{i}", "method": "POST", "url": "/v1/completions",
                      "body": {**JOB, "prompt": f"line {i}"}}) + b"\n"
        for i in range(30)
    )  # fmt: skip

    def upload() -> httpx.Response:
        return httpx.post(
            f"{gateways[0]}/v1/files",
            files={"file": ("in.jsonl", lines)},
            data={"purpose": "batch"},
            headers=auth(keys, "batcher"),
            timeout=30,
        )

    for _ in range(5):  # at its limit (getting 429), then the upload right away
        while post(gateways[0], "/v1/jobs", JOB, keys, "batcher").status_code == 202:
            pass
        refused = upload()  # (a request slot may come free in between: then again)
        if refused.status_code == 429:
            break
    assert openai_error(refused, 429)["code"] == "rate_limit_exceeded" and answers
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    time.sleep(int(refused.headers["retry-after"]))
    uploaded = upload()
    assert uploaded.status_code == 200, uploaded.text
    time.sleep(2)
    body = {"input_file_id": uploaded.json()["id"], "endpoint": "/v1/completions"}
    batch = post(gateways[1], "/v1/batches", body, keys, "batcher")
    assert batch.status_code == 200, batch.text
    batch_id = batch.json()["id"]

    def submitted() -> int:
        return sum(conn.exists(f"{prefix}:job:{{{batch_id}:l{i}}}") for i in range(30))

    deadline = time.monotonic() + 60
    while submitted() == 0:
        assert time.monotonic() < deadline, "no line was submitted"
        time.sleep(0.2)
    start, first = time.monotonic(), submitted()
    time.sleep(6)
    paced = submitted() - first
    # what the limit let accrue while the RQ steps started, then one every 2 s (the 30
    # lines all went at once before)
    assert first <= 6 and paced <= 1 + math.ceil((time.monotonic() - start) / 2), (first, paced)
    assert post(gateways[0], "/v1/jobs", JOB, keys, "batcher").status_code == 429
    post(gateways[0], f"/v1/batches/{batch_id}/cancel", None, keys, "batcher")


# Row 12: a sliding limit, and OpenAI's headers
def test_row12_no_minute_boundary_and_openais_headers(gateways, keys):
    """``--rpm 10``: 10 requests pass (with x-ratelimit-* counting down), the next 10,
    3.6 s later, do not (a fixed window let them through at the minute's end), with
    Retry-After; after that wait, one more passes."""
    first = [post(gateways[i % 2], "/v1/jobs", JOB, keys, "tight") for i in range(10)]
    assert [r.status_code for r in first] == [202] * 10
    remaining = [r.headers["x-ratelimit-remaining-requests"] for r in first]
    assert remaining == [str(n) for n in range(9, -1, -1)]
    assert {r.headers["x-ratelimit-limit-requests"] for r in first} == {"10"}
    assert first[-1].headers["x-ratelimit-reset-requests"].endswith("s")
    time.sleep(3.6)
    second = [post(gateways[i % 2], "/v1/jobs", JOB, keys, "tight") for i in range(10)]
    assert sum(r.status_code == 202 for r in second) <= 1
    refused = post(gateways[1], "/v1/jobs", JOB, keys, "tight")
    assert openai_error(refused, 429)["code"] == "rate_limit_exceeded"
    assert 1 <= int(refused.headers["retry-after"]) <= 6
    time.sleep(int(refused.headers["retry-after"]))
    assert post(gateways[0], "/v1/jobs", JOB, keys, "tight").status_code == 202


# Row 13: slowloris, and one client's connections
def test_row13_slow_headers_are_cut_and_one_client_cannot_take_every_connection(gateways):
    """300 connections from 127.0.0.1 sending their headers a byte a second: the second
    gateway (--header-timeout 2 --max-connections-per-client 50) answers the 250 past
    the cap with 429 at once and the 50 others with 408 after 2 s, and meanwhile serves
    a client from another address at once."""
    socks = slowloris(gateways[1], 300)
    start = time.monotonic()
    transport = httpx.HTTPTransport(local_address="127.0.0.2")
    with httpx.Client(transport=transport, timeout=5) as other:
        assert other.get(f"{gateways[1]}/healthz").status_code == 200
    answers = drip_until_answered(socks, start, 8.0)
    codes = [a[0].split(b" ", 2)[1] if a[0].startswith(b"HTTP/1.1") else b"closed"
             for a in answers.values()]  # fmt: skip
    assert len(answers) == 300 and codes.count(b"429") == 250, codes
    late = [t for (data, t) in answers.values() if b" 408 " in data[:20]]
    assert len(late) == 50 and all(1.8 <= t <= 3.5 for t in late), sorted(late)
    assert httpx.get(f"{gateways[1]}/healthz").status_code == 200  # every slot came back


# Row 8: nothing internal reaches a tenant
def test_row8_no_server_paths_or_worker_names_for_a_tenant(gateways, keys, registry):
    models = httpx.get(f"{gateways[0]}/v1/models", headers=auth(keys, "acme")).json()["data"]
    assert not any(registry[n].path in orjson.dumps(models).decode() for n in registry)
    admin = httpx.get(f"{gateways[1]}/v1/models", headers=auth(keys, "ops")).json()["data"]
    assert {m["root"] for m in admin} >= {registry["ad-qv"].path}  # an admin sees them

    done = post(gateways[0], "/v1/completions", JOB, keys).json()
    assert done["id"].startswith("cmpl-") and "acme" not in done["id"]
    job = post(gateways[1], "/v1/jobs", JOB, keys).json()
    result = finished(gateways[0], job["id"], keys)["result"]
    assert "path" not in result["adapter"] and result["worker"] is None
    events = httpx.get(f"{gateways[1]}/v1/jobs/{job['id']}/events", headers=auth(keys, "acme"))
    assert "lora_path" not in events.text and '"worker"' not in events.text
    assert "acme~" not in events.text and "acme~" not in orjson.dumps(result).decode()


def test_row8_a_workers_error_names_the_public_id_and_the_parameter(gateways, keys):
    bad = {**JOB, "prompt": [999_999]}  # a token id outside the vocabulary: the worker says so
    error = openai_error(post(gateways[0], "/v1/completions", bad, keys), 400)
    assert error["param"] == "prompt" and "acme" not in error["message"]
    with httpx.stream("POST", f"{gateways[1]}/v1/completions", json={**bad, "stream": True},
                      headers=auth(keys, "acme"), timeout=60) as stream:  # fmt: skip
        lines = [line for line in stream.iter_lines() if line.startswith("data: {")]
    streamed = orjson.loads(lines[-1].removeprefix("data: "))["error"]
    assert {k: streamed[k] for k in ("type", "param")} == {
        "type": error["type"],
        "param": "prompt",
    }  # typed as the same failure is without streaming
    job = post(gateways[0], "/v1/jobs", {**bad, "request_id": "mine-1"}, keys).json()
    failed = finished(gateways[1], job["id"], keys)
    assert failed["status"] == "failed" and "mine-1" in failed["result"]["error"]
    assert "acme" not in failed["result"]["error"]


def test_row8_a_key_ids_existence_does_not_show_in_the_time(keys, redis_url, prefix):
    """A wrong secret for an existing key id, for an unknown one, and a malformed key do
    the same work (one Redis read, one parse, one sha256, one constant-time compare):
    the medians of 2,000 interleaved lookups each are within 15 µs. (Before, a malformed
    key skipped the Redis read: 0.8 against 90 µs here; over HTTP the issue saw 1.0
    against 2.9 ms.)"""
    import asyncio

    from lorapool.connection import connect_async
    from lorapool.producer.api_keys import authenticate

    kinds = {"existing id": f"lp_{keys['acme-id']}_" + "x" * 43,
             "unknown id": "lp_0123456789abcdef_" + "x" * 43, "malformed": "not-a-key"}  # fmt: skip

    async def measure() -> dict[str, float]:
        connection, times = connect_async(redis_url), {k: [] for k in kinds}
        try:
            for i in range(2200):
                for kind, key in kinds.items():
                    start = time.perf_counter()
                    assert await authenticate(connection, Keys(prefix), key) is None
                    if i >= 200:  # the first ones warm the connection
                        times[kind].append(time.perf_counter() - start)
        finally:
            await connection.aclose()
        return {k: statistics.median(v) * 1e6 for k, v in times.items()}

    medians = asyncio.run(measure())
    assert max(medians.values()) - min(medians.values()) < 15, medians


# Row 9: limits at the door
@pytest.mark.parametrize(("path", "change", "param"), LIMITS)
def test_row9_limits_are_checked_at_the_door(gateways, keys, path, change, param):
    error = openai_error(post(gateways[0], path, {**JOB, **change}, keys), 400)
    assert error["param"] == param, error


def test_row9_chat_names_top_logprobs_and_max_completion_tokens(gateways, keys):
    chat = {"model": "ad-qv", "messages": [{"role": "user", "content": "x"}]}
    error = openai_error(
        post(
            gateways[1],
            "/v1/chat/completions",
            {**chat, "logprobs": True, "top_logprobs": 21},
            keys,
        ),  # fmt: skip
        400,
    )
    assert error["param"] == "top_logprobs" and "top_logprobs" in error["message"]
    error = openai_error(post(gateways[1], "/v1/chat/completions",
                         {**chat, "max_completion_tokens": 100_000}, keys), 400)  # fmt: skip
    assert error["param"] == "max_completion_tokens"


def test_row9_seed_at_the_edges_of_its_range_is_taken(gateways, keys):
    for seed in (2**63 - 1, -(2**63)):
        assert post(gateways[0], "/v1/jobs", {**JOB, "seed": seed}, keys).status_code == 202


# Row 10: FastAPI's and Starlette's own errors in OpenAI's shape
def test_row10_unknown_route_wrong_method_bad_multipart(gateways, keys):
    url = gateways[0]
    assert openai_error(httpx.get(f"{url}/v1/nothing-here"), 404)["code"] == "not_found"
    assert openai_error(httpx.put(f"{url}/v1/models"), 405)["code"] == "method_not_allowed"
    assert openai_error(httpx.delete(f"{url}/v1/completions", headers=auth(keys, "acme")), 405)
    bad = httpx.post(
        f"{url}/v1/files",
        content=b"--x\r\nContent-Disposition: form-data; name=purpose\r\n\r\nbatch\r\n--x--",
        headers={**auth(keys, "acme"), "Content-Type": "multipart/form-data; boundary=x"},
    )
    assert openai_error(bad, 400)["param"] == "file"
    garbage = httpx.post(
        f"{url}/v1/files",
        content=b"\x00" * 100,
        headers={**auth(keys, "acme"), "Content-Type": "multipart/form-data; boundary="},
    )
    assert garbage.status_code == 400 and set(garbage.json()["error"]) >= {"message", "type"}


# Row 11: request ids that would be unreachable
@pytest.mark.parametrize("rid", ["a/b", "../../x", "..", ".", "/lead"])
def test_row11_an_id_that_cannot_be_reached_by_its_location_is_refused(gateways, keys, rid):
    error = openai_error(post(gateways[1], "/v1/jobs", {**JOB, "request_id": rid}, keys), 400)
    assert error["param"] == "request_id"


@pytest.mark.parametrize("rid", ["a%2Fb", "weird id?#", "Ā-ü", "a\\b"])
def test_row11_other_odd_ids_stay_reachable_at_their_location(gateways, keys, rid):
    submitted = post(gateways[1], "/v1/jobs", {**JOB, "request_id": rid}, keys)
    assert submitted.status_code == 202, submitted.text
    location = submitted.headers["location"]
    got = httpx.get(f"{gateways[0]}{location}", headers=auth(keys, "acme"))
    assert got.status_code == 200 and got.json()["id"] == rid


# Every route, any body, any headers: never a 500, every error in OpenAI's shape
@pytest.fixture(scope="module")
def fuzz_routes(gateways):
    return routes_of(gateways[0])


@settings(deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_any_request_on_any_route_never_500_and_errors_in_openai_shape(
    gateways, keys, fuzz_routes, data
):
    method, path, headers, body = data.draw(hostile_requests(fuzz_routes, keys))
    url = gateways[data.draw(st.integers(0, 1))] + path
    with httpx.stream(method, url, headers=headers, content=body, timeout=30) as response:
        status, kind = response.status_code, response.headers.get("content-type", "")
        content = b""
        for part in response.iter_bytes():
            content += part
            if len(content) > 4096 or "event-stream" in kind:
                break  # a stream that began is not this test's business
    assert status < 500, (method, path, status, content[:300])
    if status >= 400 and "json" in kind:
        error = orjson.loads(content)["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
    elif status >= 400:
        assert "html" in kind and path.startswith("/dashboard"), (path, status, kind)
