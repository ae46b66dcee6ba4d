"""The curl commands ``lorapool demo`` prints run as printed: pasted into a shell (real
``curl``) against a real gateway, the POST queues a job (202's body) and the GET finds
it. The demo's own gateway stops with the demo, so it also prints how to start one on
the same port and prefix (``show_gateway``)."""

import os
import shutil
import subprocess
import uuid

import orjson
import pytest
from gateway_procs import serve, stop

from lorapool.cli.demo_gateway import curl_commands
from lorapool.producer import Producer

pytestmark = pytest.mark.integration


def test_the_printed_curl_commands_work_when_pasted(redis_url, tmp_path):
    if shutil.which("curl") is None:
        pytest.skip("no curl on PATH")
    prefix = f"test-curl-{uuid.uuid4().hex[:8]}"
    adapter = tmp_path / "poet"
    adapter.mkdir()
    (adapter / "adapter_model.safetensors").write_bytes(b"weights")
    producer = Producer(redis_url, prefix=prefix)
    producer.registry.add("poet", adapter)
    url, proc = serve(redis_url, prefix, tmp_path)
    try:
        body = {"model": "poet", "prompt": "The sea at night", "max_tokens": 16}
        post, get = curl_commands(url, body, f"demo-{uuid.uuid4().hex[:8]}")
        shell = {"shell": True, "capture_output": True, "text": True, "timeout": 30}
        posted = subprocess.run(post, **shell)
        job = orjson.loads(posted.stdout)
        assert job.get("object") == "job" and job["status"] == "queued", posted.stdout
        got = subprocess.run(get, env={**os.environ, "JOB": job["id"]}, **shell)
        assert orjson.loads(got.stdout)["id"] == job["id"], got.stdout
    finally:
        stop(proc)
        for key in producer.redis.scan_iter(f"{prefix}:*"):
            producer.redis.delete(key)
