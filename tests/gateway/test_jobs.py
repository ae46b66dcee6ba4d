"""The asynchronous job API over HTTP against a real pool: the oracle for results is
the Producer (the Python client of the same pool), for events the job's own result."""

from __future__ import annotations

import time
import uuid

import httpx
import pytest
from gateway_client import poll, read_events, submit

from lorapool.batch.webhook_secrets import WebhookSecrets
from lorapool.protocol import SamplingParams

pytestmark = pytest.mark.integration
BODY = {"model": "ad-qv", "prompt": "Once upon a time", "max_tokens": 24, "temperature": 0}


def test_submit_poll_result_equals_the_producers(gateway, producer):
    response = submit(gateway, BODY)
    assert response.status_code == 202
    job_id = response.json()["id"]
    assert response.headers["location"] == f"/v1/jobs/{job_id}"
    job = poll(gateway, job_id)
    want = producer.submit(
        "Once upon a time", SamplingParams(max_tokens=24, temperature=0), lora_request="ad-qv"
    ).result(timeout=120)
    assert job["status"] == "finished" and job["model"] == "ad-qv"
    [out] = job["result"]["outputs"]
    assert out["text"] == want.outputs[0].text
    assert out["token_ids"] == want.outputs[0].token_ids
    assert job["result"]["prompt_token_ids"] == want.prompt_token_ids
    assert job["result"]["usage"]["completion_tokens"] == len(want.outputs[0].token_ids)
    assert job["result"]["worker"] == want.worker


def test_result_names_the_adapter_and_its_weights(gateway, registry):
    job = poll(gateway, submit(gateway, {**BODY, "model": "ad-mlp"}).json()["id"])
    record = registry["ad-mlp"]
    assert job["result"]["adapter"] == {
        "name": "ad-mlp",
        "id": record.id,
        "path": record.path,
        "sha256": record.sha256,
    }


def test_a_chat_job(gateway, client):
    messages = [{"role": "user", "content": "Tell me a story"}]
    body = {"model": "ad-qv", "messages": messages, "max_tokens": 10, "temperature": 0}
    job = poll(gateway, submit(gateway, body).json()["id"])
    chat = client.chat.completions.create(
        model="ad-qv", messages=messages, max_tokens=10, temperature=0
    )
    assert job["result"]["outputs"][0]["text"] == chat.choices[0].message.content


def test_idempotency_key_gives_one_job(gateway, producer):
    key = f"order-{uuid.uuid4()}"
    first = submit(gateway, BODY, **{"Idempotency-Key": key})
    second = submit(gateway, BODY, **{"Idempotency-Key": key})
    assert first.status_code == second.status_code == 202
    assert first.json()["id"] == second.json()["id"]
    assert poll(gateway, first.json()["id"])["status"] == "finished"
    third = submit(gateway, BODY, **{"Idempotency-Key": key})
    assert third.json()["id"] == first.json()["id"] and third.json()["status"] == "finished"
    own = f"mine-{uuid.uuid4().hex}"
    assert submit(gateway, {**BODY, "request_id": own}).json()["id"] == own
    assert submit(gateway, {**BODY, "request_id": own}).json()["id"] == own


def test_events_resume_from_the_middle_with_exactly_the_rest(gateway):
    body = {**BODY, "max_tokens": 40, "ignore_eos": True}
    job_id = submit(gateway, body).json()["id"]
    events = read_events(gateway, job_id)
    assert [e[1] for e in events] == ["chunk"] * len(events)
    assert [int(e[0]) for e in events] == list(range(len(events)))
    assert len(events) >= 3, "too few chunks to resume from the middle"
    job = poll(gateway, job_id)
    texts = "".join(o["text"] for _, _, data in events for o in data["outputs"])
    assert texts == job["result"]["outputs"][0]["text"]
    assert events[-1][2]["finished"] and not any(e[2]["finished"] for e in events[:-1])
    middle = len(events) // 2
    rest = read_events(gateway, job_id, last_event_id=events[middle][0])
    assert rest == events[middle + 1 :]
    assert read_events(gateway, job_id, last_event_id=events[-1][0]) == []


def test_delete_aborts_a_running_job(gateway):
    body = {**BODY, "max_tokens": 480, "ignore_eos": True}
    job_id = submit(gateway, body).json()["id"]
    deadline = time.monotonic() + 60
    while httpx.get(f"{gateway}/v1/jobs/{job_id}").json()["status"] != "running":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    response = httpx.delete(f"{gateway}/v1/jobs/{job_id}")
    assert response.status_code == 202 and response.json()["status"] == "aborting"
    job = poll(gateway, job_id)
    assert job["status"] == "aborted"
    [out] = job["result"]["outputs"]
    assert out["finish_reason"] == "abort" and 0 < len(out["token_ids"]) < 480
    again = httpx.delete(f"{gateway}/v1/jobs/{job_id}")
    assert again.status_code == 200 and again.json()["status"] == "aborted"


@pytest.mark.parametrize("job_id", ["no-such-job", "a{b}", "x" * 300])
def test_unknown_jobs_are_not_found(gateway, job_id):
    for method in ("GET", "DELETE"):
        response = httpx.request(method, f"{gateway}/v1/jobs/{job_id}")
        assert response.status_code == 404
        assert response.json()["error"]["code"] == "job_not_found"
    assert httpx.get(f"{gateway}/v1/jobs/{job_id}/events").status_code == 404


@pytest.mark.parametrize(
    ("body", "headers", "param"),
    [
        ({**BODY, "request_id": "a{b"}, {}, "request_id"),
        ({**BODY, "request_id": 5}, {}, "request_id"),
        ({**BODY, "request_id": "x"}, {"Idempotency-Key": "k"}, "request_id"),
        ({**BODY, "stream": True}, {}, "stream"),
        ({**BODY, "prompt": ["a", "b"]}, {}, "prompt"),
        ({**BODY, "top_k": "3"}, {}, "top_k"),
        ({**BODY, "on_finish": "myapp.tasks.run_anything"}, {}, "on_finish"),
        ({**BODY, "on_finish": "ftp://x/y"}, {}, "on_finish"),
        ({**BODY, "on_finish": 7}, {}, "on_finish"),
        ({**BODY, "on_finish": "https://x/\u0000"}, {}, "on_finish"),
    ],
)
def test_bad_job_submissions_name_the_field(gateway, body, headers, param):
    response = submit(gateway, body, **headers)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_a_webhook_rides_in_the_jobs_marker(gateway, producer):
    """POST /v1/jobs with on_finish: the URL the callback dispatcher POSTs the result to
    (lorapool/batch/callbacks.py) is kept with the job (hooks.example.com resolves to a
    public address through the test resolver hook: tests/conftest.py)."""
    hook = "https://hooks.example.com/lorapool?order=7"
    refused = submit(gateway, {**BODY, "on_finish": hook}).json()["error"]
    assert refused["param"] == "on_finish" and "no webhook secret" in refused["message"]
    WebhookSecrets(producer.redis, producer.keys).current("")
    job_id = submit(gateway, {**BODY, "on_finish": hook}).json()["id"]
    assert producer.redis.hget(producer.keys.job(job_id), "on_finish") == hook.encode()
    assert poll(gateway, job_id)["status"] == "finished"


@pytest.mark.parametrize(
    "hook",
    [
        "http://169.254.169.254/latest/meta-data/iam/security-credentials/",
        "http://localhost:6379/",
        "http://127.0.0.1:8000/v1/jobs",
        "http://[::1]/",
        "http://10.0.0.5/",
        "http://inward.example/",  # the resolver hook: 127.0.0.1
        "http://nowhere.invalid/",
    ],
)
def test_a_webhook_pointing_inward_is_refused_at_submit(gateway, hook):
    response = submit(gateway, {**BODY, "on_finish": hook})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "on_finish" and error["type"] == "invalid_request_error"
    assert "refused" in error["message"] or "resolve" in error["message"]


def test_bad_last_event_id(gateway):
    job_id = submit(gateway, BODY).json()["id"]
    response = httpx.get(f"{gateway}/v1/jobs/{job_id}/events", headers={"Last-Event-ID": "x"})
    assert response.status_code == 400


def test_shutdown_ends_event_streams_cleanly_and_the_job_goes_on(
    redis_url, prefix, worker, producer, tmp_path
):
    """SIGTERM: an open events stream ends at once as a well-formed response (a browser
    reconnects elsewhere with Last-Event-ID), the gateway exits, the job is not aborted."""
    import signal

    from gateway_procs import free_port, start_gateway, wait_until

    port = free_port()
    proc = start_gateway(redis_url, prefix, port, tmp_path)
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: _answers(url), "the gateway answering", 60)
    body = {**BODY, "max_tokens": 400, "ignore_eos": True, "n": 8}
    job_id = submit(url, body).json()["id"]
    seen = []
    with httpx.stream("GET", f"{url}/v1/jobs/{job_id}/events", timeout=60) as response:
        for line in response.iter_lines():  # ends without a protocol error
            if line.startswith("id: "):
                seen.append(int(line[4:]))
                if len(seen) == 2:
                    started = time.monotonic()
                    proc.send_signal(signal.SIGTERM)
    assert time.monotonic() - started < 3
    # uvicorn re-raises the signal; 30 s: the no-server run of `make test` on a loaded
    # 2-core box once took longer than 15 s to get through the lifespan's shutdown
    assert proc.wait(timeout=30) in (0, -signal.SIGTERM)
    result = producer.handle(job_id).result(timeout=120)
    assert {c.finish_reason for c in result.outputs} == {"length"}


def _answers(url: str) -> bool:
    try:
        return httpx.get(f"{url}/healthz", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


@pytest.mark.parametrize("request_id", ["Āb-日本-", "a b?c#d%"])
def test_location_of_any_request_id_leads_back_to_the_job(gateway, request_id):
    """``Location`` is a URI reference: an id outside latin-1 or with reserved characters
    is percent-encoded (it used to answer 500), and following it finds the same job."""
    request_id += uuid.uuid4().hex[:6]  # here, not in the id: pytest-xdist's processes
    response = submit(gateway, {**BODY, "max_tokens": 2, "request_id": request_id})
    assert response.status_code == 202, response.text
    location = response.headers["location"]
    assert location.isascii() and "/" not in location.removeprefix("/v1/jobs/")
    followed = httpx.get(f"{gateway}{location}", timeout=30)
    assert followed.status_code == 200 and followed.json()["id"] == response.json()["id"]
