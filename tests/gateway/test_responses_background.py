"""A stored response's input items and background responses, with the official ``openai``
client against a real pool (the tiny random model, a worker process, ``lorapool serve``):
``responses.input_items.list`` (the SDK's own cursor pagination follows our pages),
``responses.create(background=True)``, ``responses.retrieve`` polled to the end and
``responses.cancel``. Oracles: the engine's ``LLM.chat`` in this process for a
response's text, and the job's own record (``GET /v1/jobs/{id}``) for a cancelled job."""

from __future__ import annotations

import os
import signal
import time

import httpx
import openai
import orjson
import pytest
from gateway_procs import serve, stop

from lorapool.lifecycle.keys import Keys
from lorapool.protocol import SamplingParams
from lorapool.records.adapter import lora_from_record

pytestmark = pytest.mark.integration
ASK = "Where does the lazy dog sleep?"
SYSTEM = "You answer briefly."
LONG = 1500  # tokens: seconds of work for the tiny model, past a lease renewal (3.3 s)
TIME = {"type": "object", "properties": {"zone": {"type": "integer"}}, "required": ["zone"]}


@pytest.fixture(scope="module")
def base(tiny_model_path):
    """The tiny llama with room for a long reply in its context."""
    return tiny_model_path("llama", max_position_embeddings=2048)


BRIEF = {"instructions": SYSTEM, "input": ASK, "temperature": 0.0, "max_output_tokens": 12}


def _engine(llm, registry, adapter: str) -> tuple[str, str]:
    """The engine's greedy text for BRIEF through ``adapter``, and the response status."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": ASK}]
    sampling = SamplingParams(temperature=0.0, max_tokens=12)
    [want] = llm.chat(messages, sampling, lora_request=lora_from_record(registry[adapter]))
    [out] = want.outputs
    return out.text, "incomplete" if out.finish_reason == "length" else "completed"


def _text(item) -> str:
    return "".join(part.text for part in item.content)


def _poll(client, response_id: str, timeout: float = 120) -> tuple[object, list[str]]:
    """The response once it has ended, and the statuses seen on the way."""
    seen, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = client.responses.retrieve(response_id)
        if not seen or seen[-1] != got.status:
            seen.append(got.status)
        if got.status not in ("queued", "in_progress"):
            return got, seen
        time.sleep(0.05)
    raise AssertionError(f"{response_id} still {seen[-1]} after {timeout}s")


def _job(gateway: str, response_id: str) -> dict:
    """The response's job as ``GET /v1/jobs/{id}`` shows it (its id: the response's)."""
    got = httpx.get(f"{gateway}/v1/jobs/{response_id.removeprefix('resp_')}", timeout=30)
    assert got.status_code == 200, got.text
    return got.json()


# -- input items --------------------------------------------------------------------------


def test_input_items_list_the_requests_input_in_pages(client):
    given = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
             {"role": "user", "content": [{"type": "input_text", "text": "c"}]},
             {"role": "developer", "content": "d"}]  # fmt: skip
    made = client.responses.create(model="ad-qv", instructions=SYSTEM, input=given,
                                   max_output_tokens=2)  # fmt: skip
    listed = client.responses.input_items.list(made.id)  # OpenAI's default: newest first
    assert [(i.role, _text(i)) for i in listed.data] == [
        ("developer", "d"), ("user", "c"), ("assistant", "b"), ("user", "a")]  # fmt: skip
    assert listed.first_id == listed.data[0].id and listed.last_id == listed.data[-1].id
    assert listed.has_more is False and listed.object == "list"
    assert listed.data[1].content[0].type == "input_text"
    assert listed.data[2].content[0].type == "output_text"
    # one item a page: the SDK follows has_more and after= to the end, oldest first
    pages = client.responses.input_items.list(made.id, order="asc", limit=1)
    assert len(pages.data) == 1 and pages.has_more is True
    walked = list(pages)
    assert [i.id for i in walked] == [i.id for i in reversed(listed.data)]
    after = client.responses.input_items.list(made.id, order="asc", after=walked[1].id)
    assert [i.id for i in after.data] == [i.id for i in walked[2:]]
    # a string input is one user message; instructions are not an item
    one = client.responses.create(model="ad-qv", instructions=SYSTEM, input=ASK,
                                  max_output_tokens=2)  # fmt: skip
    [item] = client.responses.input_items.list(one.id).data
    assert item.type == "message" and item.role == "user" and _text(item) == ASK


def test_input_items_keep_calls_and_their_outputs(client):
    tool = {"type": "function", "name": "get_time", "parameters": TIME}
    call = {"type": "function_call", "call_id": "call_1", "name": "get_time",
            "arguments": '{"zone": 1}', "id": "fc_given"}  # fmt: skip
    given = [{"role": "user", "content": "What time is it?"}, call,
             {"type": "function_call_output", "call_id": "call_1", "output": "12:00"}]  # fmt: skip
    made = client.responses.create(model="ad-qv", input=given, tools=[tool], tool_choice="none",
                                   max_output_tokens=2)  # fmt: skip
    items = client.responses.input_items.list(made.id, order="asc").data
    assert [i.type for i in items] == ["message", "function_call", "function_call_output"]
    assert items[1].id == "fc_given" and items[1].arguments == '{"zone": 1}'
    assert items[2].call_id == "call_1" and items[2].output == "12:00"


def test_input_items_refuse_what_they_cannot_page(client):
    made = client.responses.create(model="ad-qv", input=ASK, max_output_tokens=2)
    refused = [({"limit": 0}, "limit"), ({"limit": 101}, "limit"), ({"order": "up"}, "order"),
               ({"after": "msg_none"}, "after")]  # fmt: skip
    for kwargs, param in refused:
        with pytest.raises(openai.BadRequestError) as caught:
            client.responses.input_items.list(made.id, **kwargs)
        assert caught.value.body["param"] == param
    unstored = client.responses.create(model="ad-qv", input=ASK, store=False, max_output_tokens=2)
    for missing in (unstored.id, "resp_0000"):
        with pytest.raises(openai.NotFoundError):
            client.responses.input_items.list(missing)


# -- background responses -----------------------------------------------------------------


def test_a_background_response_is_queued_then_polled_to_the_engines_text(client, llm, registry):
    made = client.responses.create(**BRIEF, model="ad-qv", background=True)
    assert made.status == "queued" and made.background is True and made.output == []
    done, seen = _poll(client, made.id)
    text, status = _engine(llm, registry, "ad-qv")
    assert done.status == status and seen[-1] == status
    assert set(seen) <= {"queued", "in_progress", status}
    assert done.output_text == text and done.background is True
    # an ended background response continues as any stored one, and lists its input
    [item] = client.responses.input_items.list(made.id).data
    assert _text(item) == ASK
    again = client.responses.create(model="ad-qv", previous_response_id=made.id, input="And?",
                                    temperature=0.0, max_output_tokens=4)  # fmt: skip
    assert again.status in ("completed", "incomplete")
    # cancel after the end changes nothing (OpenAI's: it returns the response)
    assert client.responses.cancel(made.id).model_dump() == done.model_dump()


def test_cancel_stops_the_job_and_the_response_stays_cancelled(client, gateway):
    made = client.responses.create(model="ad-mlp", input=ASK, background=True,
                                   temperature=0.0, max_output_tokens=LONG)  # fmt: skip
    deadline = time.monotonic() + 60
    while client.responses.retrieve(made.id).status == "queued":  # until its job runs
        assert time.monotonic() < deadline, "no worker took the job"
        time.sleep(0.05)
    cancelled = client.responses.cancel(made.id)
    assert cancelled.status == "cancelled" and cancelled.id == made.id
    assert client.responses.cancel(made.id).status == "cancelled"  # a second cancel: the same
    job_deadline = time.monotonic() + 60
    while (job := _job(gateway, made.id))["status"] in ("queued", "running"):
        assert time.monotonic() < job_deadline, "the job was not stopped"
        time.sleep(0.2)
    assert job["status"] == "aborted", job
    assert len(job["result"]["outputs"][0]["token_ids"]) < LONG
    assert client.responses.retrieve(made.id).status == "cancelled"  # its end did not undo it


def test_a_job_its_worker_refuses_fails_the_background_response(client):
    """An input past the model's context: queued at once, then failed with the error a
    streamed response carries (``invalid_prompt``)."""
    made = client.responses.create(model="ad-qv", input="the lazy dog sleeps " * 800,
                                   background=True)  # fmt: skip
    assert made.status == "queued"
    failed, _ = _poll(client, made.id)
    assert failed.status == "failed" and failed.error.code == "invalid_prompt"
    assert "prompt" in failed.error.message and failed.output == []


def test_cancel_refuses_a_response_made_without_background(client):
    made = client.responses.create(model="ad-qv", input=ASK, max_output_tokens=2)
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.cancel(made.id)
    assert "background" in caught.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        client.responses.cancel("resp_0000")


@pytest.mark.parametrize(
    ("extra", "param", "says"),
    [({"store": False}, "background", "store"), ({"stream": True}, "stream", "poll")],
)
def test_background_without_store_or_with_stream_is_a_400(gateway, extra, param, says):
    body = {"model": "ad-qv", "input": ASK, "background": True, **extra}
    got = httpx.post(f"{gateway}/v1/responses", json=body, timeout=30)
    assert got.status_code == 400, got.text
    assert got.json()["error"]["param"] == param and says in got.json()["error"]["message"]


def test_a_background_response_outlives_the_gateway_that_made_it(
    client, llm, registry, redis_url, prefix, worker, tmp_path
):
    """The gateway that made a background response stops while its job waits (the
    worker paused): another gateway's read settles the response from the job's record,
    with the engine's text; until its job ends it cannot be continued."""
    url, proc = serve(redis_url, prefix, tmp_path, path="/readyz?min_workers=1")
    os.kill(worker.pid, signal.SIGSTOP)
    try:
        other = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        made = other.responses.create(**BRIEF, model="ad-mlp", background=True)
        stop(proc)
        assert client.responses.retrieve(made.id).status == "queued"
        with pytest.raises(openai.BadRequestError) as caught:
            client.responses.create(model="ad-mlp", previous_response_id=made.id, input="x")
        assert caught.value.body["param"] == "previous_response_id"
    finally:
        os.kill(worker.pid, signal.SIGCONT)
        stop(proc)
    done, _ = _poll(client, made.id)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": ASK}]
    sampling = SamplingParams(temperature=0.0, max_tokens=12)
    [want] = llm.chat(messages, sampling, lora_request=lora_from_record(registry["ad-mlp"]))
    assert done.output_text == want.outputs[0].text
    assert done.status == (
        "incomplete" if want.outputs[0].finish_reason == "length" else "completed"
    )
    assert done.created_at == made.created_at and done.background is True


def test_watches_past_the_stream_bound_are_left_to_the_first_read(
    client, llm, registry, redis_url, prefix, worker, conn, tmp_path
):
    """A gateway watches at most ``--max-streams`` background responses (a tenant's flood
    of them costs it no task past the bound): with a bound of 1, the first response is
    settled by its watch as its job ends, the second stays queued in Redis until a read
    (here another gateway's) settles it from its job, with the engine's text."""
    url, proc = serve(redis_url, prefix, tmp_path, "--max-streams", "1")
    os.kill(worker.pid, signal.SIGSTOP)
    try:
        bounded = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        watched, unwatched = (
            bounded.responses.create(**BRIEF, model="ad-mlp", background=True) for _ in range(2)
        )
    finally:
        os.kill(worker.pid, signal.SIGCONT)

    def stored(response_id: str) -> str:
        return orjson.loads(conn.get(Keys(prefix).response(response_id)))["response"]["status"]

    try:
        deadline = time.monotonic() + 120
        while stored(watched.id) in ("queued", "in_progress") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert stored(watched.id) in ("completed", "incomplete")
        while _job(url, unwatched.id)["status"] not in ("finished", "failed"):
            assert time.monotonic() < deadline, _job(url, unwatched.id)
            time.sleep(0.1)
        time.sleep(1.0)  # a watch, were there one, would have settled it by now
        assert stored(unwatched.id) == "queued"
    finally:
        stop(proc)
    done, _ = _poll(client, unwatched.id)
    assert (done.output_text, done.status) == _engine(llm, registry, "ad-mlp")
