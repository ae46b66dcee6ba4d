"""Issue 31 Build 4, refused at submit where the limits are known: a request whose n
sequences cannot fit in the KV cache together is a 400 on ``n`` at the gateway, judged
as the worker judges it (the prompt's slots once, then ``max_tokens`` each), on the
cache the live workers publish in their heartbeat.

A real worker process on the tiny model with a KV cache of 512 token slots (its context
is 512 too), and a gateway. The oracle is the worker itself: what the gateway refuses,
the worker refuses when a Producer sends it straight to the pool (with the same count
of slots), and what sits exactly at the bound passes the gateway and runs.
"""

from __future__ import annotations

import uuid

import httpx
import orjson
import pytest
from gateway_procs import serve, start_pool_worker, stop

from lorapool.lifecycle.keys import Keys
from lorapool.producer import Producer
from lorapool.protocol import SamplingParams

pytestmark = pytest.mark.integration
KV_CACHE_BYTES = 1 << 18  # 512 token slots of the tiny llama (512 B a token)
PROMPT = list(range(3, 15))  # 12 token ids: 12 + 5 x 100 = 512 slots, the bound
IDS = {"prompt": PROMPT, "max_tokens": 100, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def pool(redis_url, conn, model, base_name, tmp_path_factory):
    prefix = f"test-nkv-{uuid.uuid4().hex[:8]}"
    worker = start_pool_worker(
        conn, redis_url, prefix, model, tmp_path_factory.mktemp("w"),
        "--kv-cache-memory", str(KV_CACHE_BYTES), "--insecure-no-key",
    )  # fmt: skip
    url, gateway = serve(redis_url, prefix, tmp_path_factory.mktemp("gw"))
    yield {"url": url, "prefix": prefix, "model": base_name}
    stop(gateway)
    stop(worker)
    for key in conn.scan_iter(f"{prefix}:*"):
        conn.delete(key)


def post(pool, route: str, body: dict) -> httpx.Response:
    return httpx.post(
        f"{pool['url']}/v1/{route}", json={"model": pool["model"], **body}, timeout=120
    )


def test_the_worker_publishes_its_kv_cache(pool, conn):
    (record,) = [orjson.loads(v) for v in conn.hvals(Keys(pool["prefix"]).workers)]
    assert record["kv_capacity_tokens"] == 512 and record["max_model_len"] == 512


@pytest.mark.parametrize("route", ["completions", "jobs"])
def test_n_sequences_over_the_cache_are_a_400_on_n_as_the_worker_refuses_them(pool, conn, route):
    keys = Keys(pool["prefix"])
    before = conn.xlen(keys.requests)
    response = post(pool, route, {**IDS, "n": 6})
    assert response.status_code == 400, response.text[:300]
    error = response.json()["error"]
    assert error["param"] == "n" and "need at least 612 KV cache slots" in error["message"]
    assert "workers hold 512" in error["message"]
    assert conn.xlen(keys.requests) == before  # nothing enqueued
    # the worker's own judgement of the same request
    producer = Producer(conn, prefix=pool["prefix"])
    params = SamplingParams(n=6, max_tokens=100, ignore_eos=True)
    refused = producer.submit({"prompt_token_ids": PROMPT}, params).result(timeout=60)
    assert "n=6" in refused.error and "need at least 612 KV cache slots" in refused.error


def test_n_sequences_at_the_bound_pass_and_run(pool):
    response = post(pool, "completions", {**IDS, "n": 5})
    assert response.status_code == 200, response.text[:300]
    choices = response.json()["choices"]
    assert len(choices) == 5 and {c["finish_reason"] for c in choices} == {"length"}


def test_a_text_prompt_is_judged_on_its_fewest_tokens(pool):
    """A text prompt's tokens are not counted at the gateway: refused only when even a
    1-token prompt (or one that leaves a single token to generate) cannot fit."""
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 100}
    over = post(pool, "chat/completions", {**chat, "n": 6})  # 1 + 600 and 511 + 6 > 512
    assert over.status_code == 400 and over.json()["error"]["param"] == "n"
    assert "need at least 517 KV cache slots" in over.json()["error"]["message"]
    fits = post(pool, "completions", {"prompt": "hi", "max_tokens": 100, "n": 5})
    assert fits.status_code == 200, fits.text[:300]
    # no max_tokens on a chat: each may take the rest of the context (a completion's is 16)
    unbounded = post(pool, "chat/completions", {"messages": chat["messages"], "n": 2})
    assert unbounded.status_code == 400 and unbounded.json()["error"]["param"] == "n"
    assert "need at least 513 KV cache slots" in unbounded.json()["error"]["message"]
