"""Issue 51 row 1 as batch lines: a line whose grammar crashed llguidance (a 3,000-rule
Lark chain, a 3,000-deep ``$ref`` chain) killed the RQ worker validating the batch
(twice, then the batch stayed ``validating``). Now each such line fails its line with
the limit it passes named, the batch ends ``failed`` with those lines' errors, and the
RQ worker serves on. Real Redis, the gateway process, an RQ worker."""

from __future__ import annotations

import time

import httpx
import orjson
from gateway_procs import serve, stop

from lorapool.lifecycle.keys import Keys

BASE = "grammar-base"


def _ref_chain(n: int) -> dict:
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def _lark_chain(n: int) -> str:
    return "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(n)) + f'r{n}: "x"\n'


def _batch(url: str, lines: list[dict]) -> dict:
    data = b"".join(orjson.dumps(x) + b"\n" for x in lines)
    files = {"file": ("in.jsonl", data)}
    uploaded = httpx.post(f"{url}/v1/files", data={"purpose": "batch"}, files=files).json()
    created = {"input_file_id": uploaded["id"], "endpoint": "/v1/completions",
               "completion_window": "24h"}  # fmt: skip
    return httpx.post(f"{url}/v1/batches", json=created, timeout=30).json()


def test_crashing_grammars_fail_their_lines_and_the_rq_worker_serves_on(
    redis_url, conn, prefix, config, rq_worker, tmp_path, monkeypatch
):
    keys = Keys(prefix)
    conn.set(keys.model, orjson.dumps({"name": BASE, "sha256": "0" * 64}))
    monkeypatch.setenv("LORAPOOL_BATCH_QUEUE", config.queue)
    body = {"model": BASE, "prompt": "hi", "max_tokens": 2}
    schema = {"type": "json_schema", "json_schema": {"name": "r", "schema": _ref_chain(3000)}}
    lines = [
        {"custom_id": "ok", "method": "POST", "url": "/v1/completions", "body": body},
        {"custom_id": "lark", "method": "POST", "url": "/v1/completions",
         "body": {**body, "guided_grammar": _lark_chain(3000)}},
        {"custom_id": "ref", "method": "POST", "url": "/v1/completions",
         "body": {**body, "response_format": schema}},
    ]  # fmt: skip
    url, proc = serve(redis_url, prefix, tmp_path)
    try:
        batch = _batch(url, lines)
        worker = rq_worker()
        deadline = time.monotonic() + 90
        while batch["status"] not in ("failed", "completed"):
            assert time.monotonic() < deadline, batch["status"]
            assert worker.poll() is None, "the RQ worker died"
            time.sleep(0.2)
            batch = httpx.get(f"{url}/v1/batches/{batch['id']}", timeout=30).json()
        assert batch["status"] == "failed"
        errors = {e["line"]: e for e in batch["errors"]["data"]}
        assert sorted(errors) == [2, 3]
        assert errors[2]["param"] == "body.guided_grammar"
        assert "max_grammar_rules=512" in errors[2]["message"]
        assert errors[3]["param"] == "body.response_format"
        assert "max_schema_refs=256" in errors[3]["message"]
        assert worker.poll() is None, "the RQ worker died"
        # and it validates the next batch
        good = _batch(url, lines[:1])
        deadline = time.monotonic() + 90
        while good["status"] == "validating":
            assert time.monotonic() < deadline
            time.sleep(0.2)
            good = httpx.get(f"{url}/v1/batches/{good['id']}", timeout=30).json()
        assert good["status"] != "failed", good
    finally:
        stop(proc)
    assert conn.xlen(keys.batch_requests) == 1  # the good batch's line only
