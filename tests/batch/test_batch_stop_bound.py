"""A batch line meets the gateway's ``--max-stop`` as a request over HTTP does (issue 31
Build 6): a gateway run with ``--max-stop 2`` fails a batch whose line names three stop
strings while validating, with the same message and parameter, and enqueues nothing.
Real Redis, the gateway process, an RQ worker; no pool worker is needed to validate."""

from __future__ import annotations

import time

import httpx
import orjson
from gateway_procs import serve, stop

from lorapool.lifecycle.keys import Keys

BASE = "stop-bound-base"


def test_a_batch_line_over_the_gateways_max_stop_fails_validation(
    redis_url, conn, prefix, config, rq_worker, tmp_path, monkeypatch
):
    keys = Keys(prefix)
    conn.set(keys.model, orjson.dumps({"name": BASE, "sha256": "0" * 64}))
    monkeypatch.setenv("LORAPOOL_BATCH_QUEUE", config.queue)
    url, proc = serve(redis_url, prefix, tmp_path, "--max-stop", "2")
    try:
        over_http = httpx.post(
            f"{url}/v1/completions",
            json={"model": BASE, "prompt": "hi", "max_tokens": 2, "stop": ["a", "b", "c"]},
            timeout=30,
        ).json()["error"]
        body = {"model": BASE, "prompt": "hi", "max_tokens": 2}
        lines = [
            {"custom_id": "ok", "method": "POST", "url": "/v1/completions", "body": body},
            {
                "custom_id": "over",
                "method": "POST",
                "url": "/v1/completions",
                "body": {**body, "stop": ["a", "b", "c"]},
            },
        ]
        data = b"".join(orjson.dumps(x) + b"\n" for x in lines)
        files = {"file": ("in.jsonl", data)}
        uploaded = httpx.post(f"{url}/v1/files", data={"purpose": "batch"}, files=files).json()
        created = {"input_file_id": uploaded["id"], "endpoint": "/v1/completions",
                   "completion_window": "24h"}  # fmt: skip
        batch = httpx.post(f"{url}/v1/batches", json=created, timeout=30).json()
        rq_worker()
        deadline = time.monotonic() + 60
        while batch["status"] not in ("failed", "completed"):
            assert time.monotonic() < deadline, batch["status"]
            time.sleep(0.2)
            batch = httpx.get(f"{url}/v1/batches/{batch['id']}", timeout=30).json()
    finally:
        stop(proc)
    assert batch["status"] == "failed"
    (error,) = batch["errors"]["data"]
    assert error["line"] == 2 and error["param"] == "body.stop"
    assert error["message"] == f"line 2: {over_http['message']}"
    assert over_http["param"] == "stop" and "at most 2 strings" in over_http["message"]
    assert conn.xlen(keys.batch_requests) == 0


def test_lorapool_batch_submit_takes_max_stop(redis_url, conn, prefix, config, rq_worker, tmp_path):
    """``lorapool batch submit --max-stop N`` (4 unless given, as the gateway's): a line
    over it fails the batch's validation, naming ``body.stop``."""
    from click.testing import CliRunner

    from lorapool.batch import BatchService
    from lorapool.cli.main import cli

    conn.set(Keys(prefix).model, orjson.dumps({"name": BASE, "sha256": "0" * 64}))
    body = {"model": BASE, "prompt": "hi", "max_tokens": 2, "stop": ["a", "b"]}
    source = tmp_path / "in.jsonl"
    source.write_bytes(orjson.dumps({"custom_id": "x", "method": "POST",
                                     "url": "/v1/completions", "body": body}) + b"\n")  # fmt: skip
    common = ["--redis-url", redis_url, "--prefix", prefix, "--queue", config.queue]
    submitted = CliRunner().invoke(
        cli, ["batch", "submit", str(source), "--max-stop", "1", *common]
    )
    assert submitted.exit_code == 0, submitted.output
    rq_worker()
    service, batch_id = BatchService(conn, config), submitted.stdout.strip()
    deadline = time.monotonic() + 60
    while (batch := service.retrieve(batch_id))["status"] not in ("failed", "completed"):
        assert time.monotonic() < deadline, batch["status"]
        time.sleep(0.2)
    (error,) = batch["errors"]["data"]
    assert error["param"] == "body.stop" and "at most 1 strings" in error["message"]
    bad = CliRunner().invoke(cli, ["batch", "submit", str(source), "--max-stop", "65", *common])
    assert bad.exit_code == 2 and "--max-stop" in bad.output
