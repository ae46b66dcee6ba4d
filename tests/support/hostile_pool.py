"""The hostile-tenant suite's processes and helpers (tests/gateway/test_hostile_tenants.py):
two gateways with keys, the audit writer and RQ workers delivering webhooks, HTTP calls
with a tenant's key, and what a hostile request may look like."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from urllib.parse import quote

import httpx
import orjson
from gateway_procs import serve, start_audit_writer
from hypothesis import strategies as st
from json_strategies import json_values

ALLOWED = "127.0.0.40/30"  # the one internal range the operator lets webhooks reach
JOB = {"model": "ad-qv", "prompt": "hostile", "max_tokens": 3, "temperature": 0}


def start_gateways(redis_url, prefix, tmp_path_factory):
    """Two gateways of the pool (auth on, one internal receiver range allowed); the
    second with a 2 s header deadline and 50 connections a client."""
    procs, urls = [], []
    batch_env = {"LORAPOOL_BATCH_DIR": str(tmp_path_factory.mktemp("files")),
                 "LORAPOOL_BATCH_QUEUE": f"{prefix}-batch"}  # fmt: skip
    saved = {k: os.environ.get(k) for k in batch_env}
    os.environ.update(batch_env)
    try:
        guards = [(), ("--header-timeout", "2", "--max-connections-per-client", "50")]
        for i in range(2):
            cwd = tmp_path_factory.mktemp(f"gw{i}")
            extra = ("--webhook-allow", ALLOWED, *guards[i])
            url, proc = serve(redis_url, prefix, cwd, *extra, auth=True)
            procs.append(proc)
            urls.append(url)
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.update({k: v})
    return urls, procs


def start_deliveries(redis_url, prefix, cwd) -> list:
    """The audit writer (dispatching webhooks: 2 s attempts, 2 attempts) and two RQ
    workers of the callback and batch queues."""
    flags = ("--callback-queue", prefix, "--webhook-allow", ALLOWED, "--webhook-deadline", "2",
             "--webhook-max-attempts", "2", "--webhook-tenant-concurrency", "1")  # fmt: skip
    writer = start_audit_writer(redis_url, prefix, f"sqlite:///{cwd / 'a.db'}", cwd, *flags)
    rq = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                "from rq.cli import main; main()",
                "worker",
                prefix,
                f"{prefix}-batch",
                "--url",
                redis_url,
                "--serializer",
                "json",
                "--with-scheduler",
                "--worker-class",
                "lorapool.batch.rq_worker.SimpleWorker",
                "-q",
            ],
            cwd=cwd,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )  # fmt: skip
        for _ in range(2)
    ]
    return [writer, *rq]


def auth(keys, who: str) -> dict:
    return {"Authorization": f"Bearer {keys[who]}"}


def post(url: str, path: str, body, keys, who: str = "acme", **kw) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, headers=auth(keys, who), timeout=60, **kw)


def openai_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    return error


def finished(url: str, job_id: str, keys, who: str = "acme") -> dict:
    deadline = time.monotonic() + 120
    while True:
        job = httpx.get(f"{url}/v1/jobs/{job_id}", headers=auth(keys, who), timeout=30).json()
        if job["status"] not in ("queued", "running"):
            return job
        assert time.monotonic() < deadline, job
        time.sleep(0.1)


INWARD = [
    "http://169.254.169.254/latest/meta-data/iam/security-credentials/",
    "http://localhost:6411/",  # the pool's Redis, say
    "http://127.0.0.1:6379/",
    "http://[::1]:6379/",
    "http://0.0.0.0:8000/",
    "http://10.0.0.1/",
    "http://172.16.5.4/",
    "http://192.168.0.1/",
    "http://100.64.0.1/",
    "http://[fd00:ec2::254]/",
    "http://[fe80::1]/",
    "http://224.0.0.251/",
    "http://[::ffff:169.254.169.254]/",
    "http://2130706433/",  # 127.0.0.1 as one number
    "http://inward.example:8080/",  # resolves to 127.0.0.1 (the test resolver hook)
    "http://127.0.0.44/",  # just past the allowed range
]


LIMITS = [
    ("/v1/jobs", {"max_tokens": 10**12}, "max_tokens"),
    ("/v1/jobs", {"max_tokens": 100_000}, "max_tokens"),
    ("/v1/completions", {"max_tokens": 512}, "max_tokens"),  # the whole context, no prompt
    ("/v1/completions", {"prompt": list(range(1, 513))}, "prompt"),
    ("/v1/completions", {"prompt": list(range(1, 500)), "max_tokens": 20}, "max_tokens"),
    ("/v1/jobs", {"logprobs": 21}, "logprobs"),
    ("/v1/jobs", {"logprobs": 10**6}, "logprobs"),
    ("/v1/jobs", {"seed": 2**63}, "seed"),
    ("/v1/jobs", {"seed": -(2**63) - 1}, "seed"),
]


HEADER_NAMES = ["Authorization", "Content-Type", "Idempotency-Key", "Last-Event-ID", "Origin",
                "Accept", "Cookie", "Referer", "X-Forwarded-For", "X-Forwarded-Proto",
                "Content-Encoding", "Transfer-Encoding-X", "X-Random"]  # fmt: skip
CONTENT_TYPES = ["application/json", "application/x-www-form-urlencoded", "text/plain",
                 "multipart/form-data; boundary=x", "multipart/form-data"]  # fmt: skip
HEADER_VALUE = st.text(st.characters(min_codepoint=32, max_codepoint=255), max_size=40)


def routes_of(url: str) -> list[tuple[str, str]]:
    spec = httpx.get(f"{url}/openapi.json", timeout=10).json()
    routes = [(m.upper(), p) for p, methods in spec["paths"].items() for m in methods]
    return routes + [("POST", "/dashboard/login"), ("POST", "/dashboard/logout")]


@st.composite
def hostile_requests(draw, routes: list, keys: dict):
    method, path = draw(st.sampled_from(routes))
    path = re.sub(r"\{[^}]+\}", lambda _: quote(draw(st.text(max_size=12)), safe=""), path)
    if draw(st.booleans()):
        method = draw(st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH"]))
    headers = draw(st.dictionaries(st.sampled_from(HEADER_NAMES), HEADER_VALUE, max_size=4))
    who = draw(st.sampled_from([None, "acme", "ops", "garbage"]))
    if who is not None:
        headers["Authorization"] = f"Bearer {keys.get(who, 'lp_garbage')}"
    headers.setdefault("Content-Type", draw(st.sampled_from(CONTENT_TYPES)))
    body = draw(st.one_of(json_values().map(orjson.dumps), st.binary(max_size=200)))
    headers = {k: v.strip(" \t").encode("latin-1") for k, v in headers.items()}  # as h11 sends
    return method, path, headers, body


def slowloris(url: str, count: int) -> list:
    """``count`` connections to the gateway at ``url``, each with part of a request's
    headers sent."""
    import socket

    host, port = url.removeprefix("http://").split(":")
    socks = []
    for _ in range(count):
        sock = socket.create_connection((host, int(port)), timeout=10)
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
        socks.append(sock)
    return socks


def drip_until_answered(socks: list, start: float, within: float) -> dict:
    """A header byte now and then on each connection until it is answered or closed:
    socket index -> (what came back, seconds since ``start``); the sockets closed."""
    answers: dict[int, tuple[bytes, float]] = {}
    while len(answers) < len(socks) and time.monotonic() - start < within:
        for i, sock in enumerate(socks):
            if i in answers:
                continue
            sock.settimeout(0.01)
            try:
                data = sock.recv(4096)  # an answer (or the end) first, then more of a header
            except (TimeoutError, BlockingIOError):
                sock.sendall(b"X")  # a byte of a header, as slowly as it likes
                continue
            except OSError:
                data = b""
            answers[i] = (data, time.monotonic() - start)
        time.sleep(0.2)
    for sock in socks:
        sock.close()
    return answers
