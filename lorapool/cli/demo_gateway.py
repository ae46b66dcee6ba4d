"""The demo's gateway part: ``lorapool serve`` over the demo's pool, one chat request
with the ``openai`` client and one job through ``/v1/jobs``, shown as the curl
commands a web app would send."""

from __future__ import annotations

import socket
import subprocess
import time
import uuid

import orjson
from rich.console import Console

from lorapool import egress
from lorapool.egress import EgressPolicy


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# the demo calls the gateway it started on this machine: the one internal address let through
LOCAL = EgressPolicy(allow=("127.0.0.1/32",), deadline_s=30.0)


def _call(method: str, url: str, body: dict | None = None, **headers: str) -> tuple[int, dict]:
    """One call of the demo's gateway through the egress module: (status, JSON body)."""
    data = b"" if body is None else orjson.dumps(body)
    head = [("Content-Type", "application/json"), *headers.items()]
    response = egress.request(method, url, data, head, LOCAL)
    return response.status, orjson.loads(response.body) if response.body else {}


def start_gateway(url: str, prefix: str, console: Console) -> tuple[subprocess.Popen, str]:
    """``lorapool serve`` without keys (the demo's pool is local), once it answers."""
    from lorapool.cli.demo_pipeline import child_cwd, lorapool_cmd

    port = _free_port()
    cmd = lorapool_cmd("serve", "--no-auth", "--port", str(port), "--redis-url", url)
    proc = subprocess.Popen([*cmd, "--prefix", prefix, "--log-level", "warning"], cwd=child_cwd())
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if _call("GET", f"{base}/readyz?min_workers=1")[0] == 200:
                console.print(f"gateway: {base} (OpenAPI at {base}/docs)")
                return proc, base
        except egress.EgressError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("the gateway did not become ready")


def show_gateway(url: str, prefix: str, console: Console, adapter: str = "poet") -> None:
    """One OpenAI chat completion and one asynchronous job through the gateway."""
    from lorapool.cli.demo_pipeline import stop_children

    proc, base = start_gateway(url, prefix, console)
    try:
        _openai_chat(base, adapter, console)
        _job(base, adapter, console)
    finally:  # never left running (a gateway that did not stop in 30 s outlived the demo)
        stop_children([proc], timeout_s=30)
    port = base.rsplit(":", 1)[1]
    console.print(
        "(the demo's gateway stopped with the demo: to send these curl commands yourself, "
        f"start a worker and a gateway on the pool: `lorapool worker --prefix {prefix} ...` "
        f"and `lorapool serve --no-auth --port {port} --prefix {prefix}`; a gateway with "
        "keys also takes -H 'Authorization: Bearer $KEY')"
    )


def curl_commands(base: str, body: dict, key: str) -> tuple[str, str]:
    """The POST of a job and the GET of its result as a shell runs them (the job id of
    the GET: ``$JOB``, from the POST's answer)."""
    data = orjson.dumps(body).decode()
    post = (
        f"curl -s -X POST {base}/v1/jobs -H 'Content-Type: application/json' "
        f"-H 'Idempotency-Key: {key}' -d '{data}'"
    )
    return post, f"curl -s {base}/v1/jobs/$JOB"


def _openai_chat(base: str, adapter: str, console: Console) -> None:
    try:
        from openai import OpenAI
    except ImportError:
        console.print("(pip install openai to see the OpenAI client through the gateway)")
        return
    client = OpenAI(base_url=f"{base}/v1", api_key="demo")
    messages = [{"role": "user", "content": "A haiku about the harbour, please."}]
    console.print(f"[bold]openai[/] client.chat.completions.create(model={adapter!r}, ...):")
    reply = client.chat.completions.create(
        model=adapter, messages=messages, max_tokens=32, temperature=0
    )
    console.print(
        f"  {reply.choices[0].message.content!r} ({reply.usage.completion_tokens} tokens)"
    )


def _job(base: str, adapter: str, console: Console) -> None:
    body = {"model": adapter, "prompt": "The sea at night", "max_tokens": 16}
    # one key per run: the audit table outlives a run, and the same key (the same
    # request id) in the next run would meet the first run's row as a conflict
    key = f"demo-{uuid.uuid4().hex[:8]}"
    post, get = curl_commands(base, body, key)
    console.print(post, markup=False, highlight=False, soft_wrap=True)
    status, submitted = _call("POST", f"{base}/v1/jobs", body, **{"Idempotency-Key": key})
    job_id = submitted["id"]
    console.print(f"  {status} Location: /v1/jobs/{job_id}")
    console.print(get.replace("$JOB", job_id), markup=False, highlight=False, soft_wrap=True)
    deadline = time.monotonic() + 300
    job = _call("GET", f"{base}/v1/jobs/{job_id}")[1]
    while job["status"] in ("queued", "running") and time.monotonic() < deadline:
        time.sleep(0.2)
        job = _call("GET", f"{base}/v1/jobs/{job_id}")[1]
    result = job.get("result") or {}
    adapter_info = result.get("adapter") or {}
    text = (result.get("outputs") or [{}])[0].get("text")
    console.print(
        f"  {job['status']}: {text!r}, adapter {adapter_info.get('name')} "
        f"(sha256 {str(adapter_info.get('sha256'))[:12]}…), worker {result.get('worker')}"
    )
