"""The official ``openai`` client against ``lorapool serve``: files.create,
batches.create, batches.retrieve, files.content, unchanged; the output equals the
engine's offline API line by line."""

from __future__ import annotations

import time

import orjson
import pytest
from gateway_procs import serve, stop

pytestmark = pytest.mark.usefixtures("worker")


@pytest.fixture
def client(redis_url, prefix, config, tmp_path, monkeypatch):
    import openai

    monkeypatch.setenv("LORAPOOL_BATCH_QUEUE", config.queue)
    url, proc = serve(redis_url, prefix, tmp_path, path="/readyz?min_workers=1")
    yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
    stop(proc)


def test_the_openai_client_runs_a_batch(
    client, rq_worker, make_lines, registry, base_name, oracle, tmp_path
):
    lines = make_lines(12, [*registry, base_name], url="/v1/chat/completions")
    source = tmp_path / "in.jsonl"
    source.write_bytes(b"".join(orjson.dumps(x) + b"\n" for x in lines))
    with open(source, "rb") as f:
        uploaded = client.files.create(file=f, purpose="batch")
    assert uploaded.bytes == source.stat().st_size
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    assert batch.status == "validating"
    rq_worker()
    deadline = time.monotonic() + 180
    while (batch := client.batches.retrieve(batch.id)).status not in {"completed", "failed"}:
        assert time.monotonic() < deadline, batch.status
        time.sleep(0.3)
    assert batch.status == "completed" and batch.request_counts.completed == 12
    outputs = [
        orjson.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()
    ]
    assert [o["custom_id"] for o in outputs] == [x["custom_id"] for x in lines]
    for line, out in zip(lines, outputs):
        choice = out["response"]["body"]["choices"][0]
        text = choice["message"]["content"] if "messages" in line["body"] else choice["text"]
        assert text == oracle(line).outputs[0].text
    usages = [o["response"]["body"]["usage"] for o in outputs]
    assert batch.usage.input_tokens == sum(u["prompt_tokens"] for u in usages) > 0
    assert batch.usage.output_tokens == sum(u["completion_tokens"] for u in usages) > 0
    assert batch.usage.total_tokens == batch.usage.input_tokens + batch.usage.output_tokens
    assert client.batches.cancel(batch.id).status == "completed"
    with pytest.raises(Exception) as missing:
        client.batches.retrieve("batch_unknown")
    assert getattr(missing.value, "status_code", None) == 404


def test_bad_batch_requests_are_refused_in_openai_shape(client, tmp_path):
    import httpx

    base = str(client.base_url).rstrip("/")
    cases = [
        (b"{not json", 400, None),
        (b"[1, 2]", 400, None),
        (b'{"input_file_id": "file-x", "endpoint": "/v1/completions", "extra": 1}', 400, "extra"),
        (b'{"input_file_id": 7, "endpoint": "/v1/completions"}', 400, "input_file_id"),
        (b'{"input_file_id": "file-x", "endpoint": "/v1/embeddings"}', 400, "endpoint"),
        (b'{"endpoint": "/v1/completions"}', 400, "input_file_id"),
        (b'{"input_file_id": "file-x", "endpoint": true}', 400, "endpoint"),
        (b'{"input_file_id": "f\xff", "endpoint": "/v1/completions"}', 400, None),  # not UTF-8
        (b'{"input_file_id": "file-x", "endpoint": "/v1/completions", "completion_window": 1e400}',
         400, "completion_window"),
        (b'{"input_file_id": "file-x", "endpoint": "/v1/completions", "completion_window": "1h"}',
         400, "completion_window"),
        (b'{"input_file_id": "file-x", "endpoint": "/v1/completions", "metadata": {"k": 1}}', 400,
         "metadata"),
        (b'{"input_file_id": "file-x", "endpoint": "/v1/completions", "metadata": [1]}', 400,
         "metadata"),
        (b'{"input_file_id": "file-' + b"0" * 32 + b'", "endpoint": "/v1/completions"}', 404,
         "file_id"),
    ]  # fmt: skip
    for body, status, param in cases:
        reply = httpx.post(f"{base}/batches", content=body, timeout=10)
        assert reply.status_code == status, (body, reply.text)
        assert reply.json()["error"]["param"] == param, body
    reply = httpx.post(f"{base}/files", files={"file": ("a.jsonl", b"{}")},
                       data={"purpose": "fine-tune"}, timeout=10)  # fmt: skip
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "purpose"
    assert httpx.get(f"{base}/files/file-nope/content", timeout=10).status_code == 404


def _wait(client, batch_id: str):
    deadline = time.monotonic() + 180
    while (batch := client.batches.retrieve(batch_id)).status not in {"completed", "failed"}:
        assert time.monotonic() < deadline, batch.status
        time.sleep(0.3)
    return batch


def test_files_list_and_delete_batches_list_and_the_endpoint_enforced(
    client, rq_worker, make_lines, registry, tmp_path
):
    """files.list and batches.list page as OpenAI's do (the client follows ``after``),
    files.delete removes, and a line whose url is not the batch's endpoint fails it."""
    import openai

    ids = []
    for i, url in enumerate(["/v1/chat/completions", "/v1/completions", "/v1/completions"]):
        source = tmp_path / f"in{i}.jsonl"
        lines = make_lines(2, list(registry), url=url)
        source.write_bytes(b"".join(orjson.dumps(x) + b"\n" for x in lines))
        with open(source, "rb") as f:
            ids.append(client.files.create(file=f, purpose="batch").id)
        time.sleep(1.05)  # created_at has a second's resolution
    listed = [f.id for f in client.files.list(limit=1)]  # one a page: follows ``after``
    ours = [i for i in listed if i in ids]
    assert ours == ids[::-1]  # newest first
    assert [f.id for f in client.files.list(order="asc") if f.id in ids] == ids
    page = client.files.list(limit=2)
    assert len(page.data) == 2 and page.has_more
    deleted = client.files.delete(ids[2])
    assert deleted.deleted is True and deleted.id == ids[2]
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(ids[2])
    with pytest.raises(openai.NotFoundError):
        client.files.delete(ids[2])
    assert ids[2] not in [f.id for f in client.files.list()]

    wrong = client.batches.create(
        input_file_id=ids[0], endpoint="/v1/completions", completion_window="24h"
    )
    right = client.batches.create(
        input_file_id=ids[1], endpoint="/v1/completions", completion_window="24h"
    )
    rq_worker()
    failed, done = _wait(client, wrong.id), _wait(client, right.id)
    assert failed.status == "failed" and done.status == "completed"
    assert {e.param for e in failed.errors.data} == {"url"}
    assert "not the batch's endpoint" in failed.errors.data[0].message
    batches = [b.id for b in client.batches.list(limit=1)]
    assert [b for b in batches if b in (wrong.id, right.id)] == [right.id, wrong.id]
    assert done.usage.output_tokens > 0 and failed.usage.total_tokens == 0
