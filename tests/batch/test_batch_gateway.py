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
    lines = make_lines(12, [*registry, base_name])
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
