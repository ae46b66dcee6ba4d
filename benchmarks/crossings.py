"""How often one chat request crosses between the gateway and ``lorapool.openai``.

The gateway runs in this process (its ASGI app through httpx's ASGI transport, its
lifespan entered); the worker is the real ``Worker`` around ``queue_gpu.StandInEngine``
(0 ms steps) in its own process, on a real Redis. One warm-up request, then one
non-streaming and one streaming ``/v1/chat/completions`` under ``sys.setprofile``:

- a crossing is a function entered (its frame's first ``call`` event: a generator or
  coroutine resumed later is counted apart, under ``resumed``) whose module is in one
  package while its calling frame's module is in the other (``gateway -> openai``: a
  gateway frame calls into ``lorapool.openai``; ``openai -> gateway`` the reverse;
  each returns the same way);
- a module is "entered" when a frame of another module calls into it (first calls).

    .venv/bin/python benchmarks/crossings.py [--redis-url URL]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from queue_gpu import AUDIT_KEY, BASE_MODEL  # noqa: E402
from standin_engine import StandInEngine  # noqa: E402

from gateway import _clean, stop  # noqa: E402

GATEWAY, OPENAI = "lorapool.gateway", "lorapool.openai"
WATCHED = ("lorapool.openai.format", "lorapool.gateway.pool", "lorapool.openai.serving")


def _package(module: str) -> str | None:
    for name in (GATEWAY, OPENAI):
        if module == name or module.startswith(name + "."):
            return name
    return None


class Crossings:
    """Counts, under ``sys.setprofile``, the calls between the two packages."""

    def __init__(self):
        self.ways: Counter = Counter()
        self.entered: Counter = Counter()
        self.calls: Counter = Counter()  # "caller.function -> callee.function"
        self.seen: dict[int, object] = {}

    def __call__(self, frame, event, arg) -> None:
        if event != "call" or frame.f_back is None:
            return
        first = id(frame) not in self.seen
        if first:  # the frame kept: its id is not reused by another while counting
            self.seen[id(frame)] = frame
        callee = frame.f_globals.get("__name__", "")
        caller = frame.f_back.f_globals.get("__name__", "")
        if callee == caller:
            return
        if callee in WATCHED and first:
            self.entered[callee] += 1
        to, frm = _package(callee), _package(caller)
        if to and frm and to != frm:
            way = f"{frm.rsplit('.', 1)[1]} -> {to.rsplit('.', 1)[1]}"
            self.ways[way if first else f"{way} (resumed)"] += 1
            back = frame.f_back.f_code.co_name
            if first:
                self.calls[f"{caller}.{back} -> {callee}.{frame.f_code.co_name}"] += 1

    def report(self) -> dict:
        return {"crossings": dict(self.ways), "entered": dict(self.entered),
                "calls": dict(self.calls)}  # fmt: skip


async def _count(app, body: dict, stream: bool) -> dict:
    import httpx

    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gw", timeout=60) as http:
        counter = Crossings()
        sys.setprofile(counter)
        try:
            response = await http.post("/v1/chat/completions", json={**body, "stream": stream})
            await response.aread()
        finally:
            sys.setprofile(None)
        assert response.status_code == 200, response.text
    return counter.report()


async def _run(url: str, prefix: str) -> dict:
    from lorapool.gateway.app import create_app
    from lorapool.gateway.config import GatewayConfig

    app = create_app(GatewayConfig(redis_url=url, prefix=prefix, auth=False))
    body = {
        "model": BASE_MODEL["name"],
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
    }
    async with app.router.lifespan_context(app):
        await _count(app, body, False)  # warm-up: caches, imports
        return {"non-streaming": await _count(app, body, False),
                "streaming": await _count(app, body, True)}  # fmt: skip


class _ChatTemplate:
    """Enough of a tokenizer for the worker to render a chat job's prompt."""

    chat_template = None

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        return " ".join(str(m.get("content")) for m in messages) + " assistant:"


class ChatStandIn(StandInEngine):
    """The stand-in engine, taking chat jobs (its tokenizer renders their messages)."""

    def get_tokenizer(self):
        return _ChatTemplate()


def serve_worker(url: str, prefix: str) -> None:
    """The real Worker around ``ChatStandIn`` (0 ms steps) until SIGTERM."""
    from lorapool.connection import connect
    from lorapool.worker import Worker, WorkerConfig

    config = WorkerConfig(prefix=prefix, name=f"cross-{prefix}", audit_key=AUDIT_KEY.encode())
    Worker(ChatStandIn(8, 0.0), connect(url), config, BASE_MODEL).run()


def worker_up(url: str, prefix: str) -> subprocess.Popen:
    import redis

    from lorapool.cli.queue_status import live_workers
    from lorapool.lifecycle.keys import Keys

    cmd = [sys.executable, __file__, "--serve-worker", "--redis-url", url, "--prefix", prefix]
    proc = subprocess.Popen(cmd)
    deadline = time.monotonic() + 60
    with redis.Redis.from_url(url) as conn:
        while f"cross-{prefix}" not in {w.name for w in live_workers(conn, Keys(prefix))}:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the worker did not start")
            time.sleep(0.05)
    return proc


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--redis-url", default=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
    )
    parser.add_argument("--serve-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--prefix", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    os.environ.setdefault("LORAPOOL_AUDIT_KEY", AUDIT_KEY)
    if args.serve_worker:
        serve_worker(args.redis_url, args.prefix)
        return {}
    prefix = f"bench-cross-{uuid.uuid4().hex[:8]}"
    worker = worker_up(args.redis_url, prefix)
    try:
        results = asyncio.run(_run(args.redis_url, prefix))
    finally:
        stop(worker)
        _clean(args.redis_url, prefix)
    print(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
