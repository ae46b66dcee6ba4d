"""What apps moving from OpenAI or vLLM read, with the official ``openai`` client (httpx
where it has no method): one choice per streamed chunk, stop_reason, system_fingerprint,
usage details, logit_bias; vLLM's /health, /ping, /version, /tokenize, /detokenize
(against transformers' tokenizer of the model directory)."""

from __future__ import annotations

import httpx
import orjson
import pytest
import vllm_checks

pytestmark = pytest.mark.integration
CHAT = [{"role": "user", "content": "Count with me"}]


def test_streaming_n3_has_one_choice_per_chunk(client, base_name):
    """A client reading ``chunk.choices[0]`` of every chunk sees all three choices, whose
    texts equal the non-streamed call's (same seed)."""
    kw = dict(model=base_name, n=3, max_tokens=10, temperature=1.0, seed=11)
    whole = client.chat.completions.create(messages=CHAT, **kw)
    texts, reasons = {}, {}
    for chunk in client.chat.completions.create(messages=CHAT, stream=True, **kw):
        assert len(chunk.choices) == 1
        choice = chunk.choices[0]
        texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
        reasons[choice.index] = choice.finish_reason or reasons.get(choice.index)
    assert texts == {c.index: c.message.content for c in whole.choices}
    assert reasons == {c.index: c.finish_reason for c in whole.choices}
    completions = client.completions.create(prompt="Once", stream=True, **kw)
    seen = set()
    for chunk in completions:
        assert len(chunk.choices) == 1
        seen.add(chunk.choices[0].index)
    assert seen == {0, 1, 2}


def test_stop_reason_and_fingerprint(client, base_name, producer):
    whole = client.completions.create(
        model=base_name, prompt="The quick", max_tokens=12, temperature=0.0
    )
    text = whole.choices[0].text
    assert len(text) > 3
    stop = text[2:4]
    got = client.completions.create(
        model=base_name, prompt="The quick", max_tokens=12, temperature=0.0, stop=[stop]
    )
    choice = got.choices[0].model_dump()
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop
    assert whole.choices[0].model_dump()["stop_reason"] is None
    sha = producer.redis.get(producer.keys.model)
    assert got.system_fingerprint == "fp_" + orjson.loads(sha)["sha256"][:12]
    assert got.usage.prompt_tokens_details.cached_tokens == 0
    streamed = list(
        client.completions.create(
            model=base_name,
            prompt="The quick",
            max_tokens=12,
            temperature=0.0,
            stop=[stop],
            stream=True,
        )
    )
    last = streamed[-1].choices[0].model_dump()
    assert last["finish_reason"] == "stop" and last["stop_reason"] == stop
    assert all(c.system_fingerprint == got.system_fingerprint for c in streamed)


def test_logit_bias_forces_a_token(client, base_name, gateway):
    got = client.completions.create(
        model=base_name,
        prompt="Hello",
        max_tokens=4,
        temperature=1.0,
        logit_bias={"300": 100},
    )
    ids = httpx.post(
        f"{gateway}/v1/completions",
        json={"model": base_name, "prompt": "Hello", "max_tokens": 4, "logit_bias": {"300": 100},
              "logprobs": 0},
        timeout=60,
    ).json()  # fmt: skip
    assert got.choices[0].text == ids["choices"][0]["text"]
    assert len(set(ids["choices"][0]["logprobs"]["tokens"])) == 1
    bad = httpx.post(
        f"{gateway}/v1/completions",
        json={"model": base_name, "prompt": "Hello", "logit_bias": {"300": 101}},
        timeout=60,
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "logit_bias"


def test_health_ping_version(gateway):
    assert httpx.get(f"{gateway}/health").status_code == 200
    assert httpx.get(f"{gateway}/health").content == b""
    assert httpx.get(f"{gateway}/ping").status_code == 200
    assert httpx.post(f"{gateway}/ping").status_code == 200
    from importlib.metadata import version

    assert httpx.get(f"{gateway}/version").json() == {"version": version("lorapool")}


def test_tokenize_and_detokenize_match_transformers(gateway, model, base_name):
    vllm_checks.tokenize_matches_transformers(gateway, model, base_name)


@pytest.mark.parametrize(
    "route, body, status, param",
    [
        ("/tokenize", {"prompt": 3}, 400, "prompt"),
        ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, 400, "add_special_tokens"),
        ("/tokenize", {"model": "no-such-model", "prompt": "x"}, 404, "model"),
        ("/tokenize", {"model": 3, "prompt": "x"}, 400, "model"),
        ("/tokenize", {"prompt": "x", "return_token_strs": 1}, 400, "return_token_strs"),
        ("/tokenize", {}, 400, "prompt"),
        ("/tokenize", {"messages": [{"role": "user"}]}, 400, "messages"),
        ("/tokenize", {"messages": [{"role": "user", "content": "x", "x": 1}]}, 400, "messages"),
        ("/tokenize", {"messages": [{"role": "u", "content": "x"}], "tools": [{}]}, 400, "tools"),
        ("/detokenize", {"tokens": [1, "a"]}, 400, "tokens"),
        ("/detokenize", {"tokens": [10**9]}, 400, "tokens"),
        ("/detokenize", {"tokens": [True]}, 400, "tokens"),
        ("/detokenize", {"tokens": [2**31]}, 400, "tokens"),
        ("/detokenize", {"tokens": None}, 400, "tokens"),
        ("/detokenize", [1, 2], 400, None),
    ],
)
def test_tokenize_refuses_bad_bodies(gateway, route, body, status, param):
    got = httpx.post(f"{gateway}{route}", json=body)
    assert got.status_code == status, got.text
    assert got.json()["error"]["param"] == param


@pytest.fixture(scope="module")
def metrics_port():
    from gateway_procs import free_port

    return free_port()


@pytest.fixture(scope="module")
def worker(redis_url, prefix, model, registry, conn, tmp_path_factory, metrics_port):
    """The pool's worker, serving its /metrics on ``metrics_port``."""
    from gateway_procs import start_pool_worker, stop

    cwd = tmp_path_factory.mktemp("worker")
    proc = start_pool_worker(
        conn, redis_url, prefix, model, cwd, "--metrics-port", str(metrics_port)
    )
    yield proc
    stop(proc)


@pytest.fixture(scope="module")
def secure(redis_url, prefix, conn, worker, tmp_path_factory):
    """A gateway with keys: (its URL, a key of tenant 'slow' allowed 1 request a minute)."""
    from gateway_procs import serve, stop

    from lorapool.lifecycle.keys import Keys
    from lorapool.producer.api_keys import ApiKeys

    _, key = ApiKeys(conn, Keys(prefix)).add("slow", "submit", rpm=1)
    url, proc = serve(redis_url, prefix, tmp_path_factory.mktemp("secure"), auth=True)
    yield url, key
    stop(proc)


def test_gateway_http_metrics_by_route_status_and_tenant(secure, base_name, scraper):
    url, key = secure
    auth = {"Authorization": f"Bearer {key}"}
    _, before = vllm_checks.scrape(f"{url}/metrics", scraper)
    body = {"model": base_name, "prompt": "Hi", "max_tokens": 2}
    assert httpx.post(f"{url}/v1/completions", json=body, headers=auth, timeout=60).is_success
    for _ in range(2):
        assert httpx.post(f"{url}/v1/completions", json=body, headers=auth).status_code == 429
    assert httpx.get(f"{url}/v1/jobs/nope", headers=auth).status_code == 429  # reads count too
    assert httpx.get(f"{url}/no/such/path/{'x' * 40}").status_code == 404
    text, after = vllm_checks.scrape(f"{url}/metrics", scraper)
    assert "_created" not in text

    def delta(name, suffix, **labels):
        value = vllm_checks.value
        return value(after, name, suffix, **labels) - value(before, name, suffix, **labels)

    route = dict(handler="/v1/completions", method="POST")
    assert delta("http_requests", "_total", status="200", **route) == 1
    assert delta("http_requests", "_total", status="429", **route) == 2
    assert delta("http_request_duration_seconds", "_count", status="429", **route) == 2
    assert delta("http_requests", "_total", handler="/v1/jobs/{job_id}", status="429") == 1
    assert delta("http_requests", "_total", handler="other", status="404") == 1
    assert delta("lorapool_gateway_rate_limited", "_total", tenant="slow") == 3
    handlers = {s.labels["handler"] for s in after["http_requests"].samples}
    assert not any("x" * 40 in h for h in handlers)  # raw paths never become labels


def test_every_grafana_query_names_an_exported_metric(
    secure, metrics_port, base_name, client, scraper
):
    """deploy/grafana/lorapool.json against what a worker and a gateway export after
    some traffic (every labelled series has a sample then)."""
    import json
    from pathlib import Path

    promql = vllm_checks.promql_metrics
    assert promql('sum by (le) (rate(a:b_bucket{x="y"}[5m])) / c') == {"a:b_bucket", "c"}
    assert promql("label_values(vllm:x, model_name)") == {"vllm:x"}
    client.completions.create(model=base_name, prompt="Hello", max_tokens=3)
    client.completions.create(model="ad-qv", prompt="Hello", max_tokens=3)  # an adapter loads
    url, _ = secure
    exported = set()
    for source, headers in ((f"http://127.0.0.1:{metrics_port}/metrics", None),
                            (f"{url}/metrics", scraper)):  # fmt: skip
        _, families = vllm_checks.scrape(source, headers)
        exported |= {s.name for f in families.values() for s in f.samples}
        # a gauge family with no series now (no adapter running) is still exported
        exported |= {f.name for f in families.values() if f.type == "gauge"}
    board = json.loads((Path(__file__).parents[2] / "deploy/grafana/lorapool.json").read_text())
    queries = [t["expr"] for p in board["panels"] for t in p.get("targets", ())]
    queries += [v["definition"] for v in board["templating"]["list"] if "definition" in v]
    assert len(queries) > 30
    named = set().union(*(promql(q) for q in queries))
    assert named - exported == set()
    assert {n for n in named if n.startswith("vllm:")} >= {
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:e2e_request_latency_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:request_queue_time_seconds_bucket",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:request_success_total",
        "vllm:prefix_cache_hits_total",
        "vllm:num_preemptions_total",
        "vllm:cache_config_info",
    }


def test_priority_picks_the_pools_stream(redis_url, conn, tmp_path_factory):
    """vLLM's priority (lower first): above 0 the batch stream, else the interactive one.
    A pool without workers, so the jobs stay in their streams."""
    import uuid

    from gateway_procs import serve, stop

    prefix = f"test-prio-{uuid.uuid4().hex[:8]}"
    conn.set(f"{prefix}:model", orjson.dumps({"name": "base", "sha256": "0" * 64}))
    url, proc = serve(redis_url, prefix, tmp_path_factory.mktemp("prio"))
    try:
        for priority in (None, -5, 0, 1, 7, 2**40):
            body = {"model": "base", "prompt": "x", "max_tokens": 2}
            if priority is not None:
                body["priority"] = priority
            assert httpx.post(f"{url}/v1/jobs", json=body).status_code == 202
        assert conn.xlen(f"{prefix}:requests") == 3
        assert conn.xlen(f"{prefix}:requests:batch") == 3
        bad = httpx.post(f"{url}/v1/jobs", json={"model": "base", "prompt": "x", "priority": 1.5})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "priority"
    finally:
        stop(proc)
        for key in conn.scan_iter(f"{prefix}:*"):
            conn.delete(key)


def test_echo_puts_the_prompt_before_each_choice(client, base_name, model):
    from transformers import AutoTokenizer

    kw = dict(model=base_name, max_tokens=6, temperature=0.0)
    plain = client.completions.create(prompt="The quick brown", **kw).choices[0].text
    echoed = client.completions.create(prompt="The quick brown", echo=True, **kw)
    assert echoed.choices[0].text == "The quick brown" + plain
    streamed = client.completions.create(prompt="The quick brown", echo=True, stream=True, **kw)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == "The quick brown" + plain
    ids = AutoTokenizer.from_pretrained(model).encode("Grüße aus")
    got = client.completions.create(prompt=ids, echo=True, **kw)
    assert got.choices[0].text.startswith(AutoTokenizer.from_pretrained(model).decode(ids))


def test_echo_logprobs_and_prompt_logprobs_match_the_engine(client, base_name, llm):
    """The prompt's logprobs (vLLM's prompt_logprobs, and echo's) are the engine's own."""
    from lorapool.protocol import SamplingParams

    prompt = "Once upon a time"
    [want] = llm.generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=4, logprobs=2, prompt_logprobs=2)
    )
    got = client.completions.create(
        model=base_name, prompt=prompt, max_tokens=4, temperature=0.0, logprobs=2, echo=True
    )
    lp = got.choices[0].logprobs
    ids = want.prompt_token_ids
    assert len(lp.tokens) == len(ids) + 4
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for i in range(1, len(ids)):
        assert lp.token_logprobs[i] == pytest.approx(want.prompt_logprobs[i][ids[i]].logprob)
    assert got.choices[0].text == prompt + want.outputs[0].text
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    extra = client.completions.create(
        model=base_name,
        prompt=prompt,
        max_tokens=2,
        temperature=0.0,
        extra_body={"prompt_logprobs": 1},
    )
    positions = extra.choices[0].model_dump()["prompt_logprobs"]
    assert positions[0] is None and len(positions) == len(ids)
    for i in range(1, len(ids)):
        entry = positions[i][str(ids[i])]
        assert entry["logprob"] == pytest.approx(want.prompt_logprobs[i][ids[i]].logprob)
        assert entry["rank"] == want.prompt_logprobs[i][ids[i]].rank
    chat = client.chat.completions.create(
        model=base_name,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=2,
        extra_body={"prompt_logprobs": 0},
    )
    assert chat.model_dump()["prompt_logprobs"][0] is None


@pytest.fixture(scope="module")
def resolving(redis_url, prefix, conn, worker, model, tmp_path_factory):
    """Two gateways with --adapter-root and keys: (URLs, root, admin key, submit key)."""
    from adapters import build_adapter
    from gateway_procs import serve, stop

    from lorapool.lifecycle.keys import Keys
    from lorapool.producer.api_keys import ApiKeys

    root = tmp_path_factory.mktemp("resolver-root")
    for i, name in enumerate(("fresh", "twin")):
        build_adapter(model, root / name, rank=8, targets=("q_proj",), seed=40 + i, std=0.2)
    outside = tmp_path_factory.mktemp("outside")
    build_adapter(model, outside / "evil", rank=8, targets=("q_proj",), seed=9, std=0.2)
    (root / "escape").symlink_to(outside / "evil")
    keys = ApiKeys(conn, Keys(prefix))
    admin, submit = keys.add("ops", "admin")[1], keys.add("ops", "submit")[1]
    procs, urls = [], []
    for i in range(2):
        cwd = tmp_path_factory.mktemp(f"resolving{i}")
        url, proc = serve(redis_url, prefix, cwd, "--adapter-root", str(root), auth=True)
        urls.append(url)
        procs.append(proc)
    yield urls, root, admin, submit
    for proc in procs:
        stop(proc)


def test_the_lora_resolver_registers_and_serves_on_first_use(resolving, producer, llm):
    from concurrent.futures import ThreadPoolExecutor

    from lorapool.identity import adapter_sha256
    from lorapool.protocol import SamplingParams
    from lorapool.records.adapter import lora_from_record

    urls, root, admin, submit = resolving
    auth = {"Authorization": f"Bearer {submit}"}
    body = {"model": "fresh", "prompt": "Hello", "max_tokens": 6, "temperature": 0.0}
    assert producer.registry.get("fresh") is None
    got = httpx.post(f"{urls[0]}/v1/completions", json=body, headers=auth, timeout=120)
    assert got.status_code == 200, got.text
    record = producer.registry.get("fresh")
    assert record.sha256 == adapter_sha256(root / "fresh")
    [want] = llm.generate(
        ["Hello"],
        SamplingParams(temperature=0.0, max_tokens=6),
        lora_request=lora_from_record(record),
    )
    assert got.json()["choices"][0]["text"] == want.outputs[0].text

    def call(i):
        twin = {**body, "model": "twin"}
        return httpx.post(f"{urls[i % 2]}/v1/completions", json=twin, headers=auth, timeout=120)

    with ThreadPoolExecutor(6) as pool:
        replies = list(pool.map(call, range(6)))
    assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
    twins = [r for r in producer.registry.list() if r.name == "twin"]
    assert len(twins) == 1 and twins[0].path == str((root / "twin").resolve())
    for name in ("escape", "..", "nowhere"):
        miss = httpx.post(f"{urls[1]}/v1/completions", json={**body, "model": name}, headers=auth)
        assert miss.status_code == 404, (name, miss.text)
        assert producer.registry.get(name) is None


def test_admins_turn_the_resolver_off_for_every_gateway(resolving, producer):
    urls, root, admin, submit = resolving
    admin_auth, auth = {"Authorization": f"Bearer {admin}"}, {"Authorization": f"Bearer {submit}"}
    off = httpx.post(f"{urls[0]}/v1/lora_resolver", json={"enabled": False}, headers=admin_auth)
    assert off.status_code == 200 and off.json()["enabled"] is False
    refused = httpx.post(f"{urls[0]}/v1/lora_resolver", json={"enabled": False}, headers=auth)
    assert refused.status_code == 403
    assert httpx.get(f"{urls[1]}/v1/lora_resolver", headers=admin_auth).json()["enabled"] is False
    import shutil

    shutil.copytree(root / "fresh", root / "late")
    body = {"model": "late", "prompt": "Hello", "max_tokens": 2}
    assert httpx.post(f"{urls[1]}/v1/completions", json=body, headers=auth).status_code == 404
    on = httpx.post(f"{urls[1]}/v1/lora_resolver", json={"enabled": True}, headers=admin_auth)
    assert on.json()["enabled"] is True
    got = httpx.post(f"{urls[0]}/v1/completions", json=body, headers=auth, timeout=120)
    assert got.status_code == 200, got.text
    assert producer.registry.get("late").sha256 == producer.registry.get("fresh").sha256
