"""A real worker's ``/metrics``, scraped over HTTP and read with prometheus-client's parser.

The oracles are independent of the metrics code: the jobs' own results (their
finish reasons and token counts, read back through the producer) and the
parser's reading of the exposition.
"""

import threading
import time
import urllib.request
from collections import defaultdict

import pytest
from prometheus_client.parser import text_string_to_metric_families

from lorapool.protocol import SamplingParams
from lorapool.worker import Worker, WorkerConfig
from lorapool.worker.serve import base_model_info

pytestmark = pytest.mark.integration
LAYOUTS = ("standalone", "cluster")
SHORT = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
TYPES = {
    "lorapool_requests": "counter",
    "lorapool_generation_tokens": "counter",
    "lorapool_engine_steps": "counter",
    "lorapool_lora_adapter_loads": "counter",
    "lorapool_lora_adapter_evictions": "counter",
    "lorapool_request_queue_time_seconds": "histogram",
    "lorapool_time_to_first_token_seconds": "histogram",
    "lorapool_inter_token_latency_seconds": "histogram",
    "lorapool_e2e_request_latency_seconds": "histogram",
    "lorapool_request_prompt_tokens": "histogram",
    "lorapool_request_generation_tokens": "histogram",
    "lorapool_batch_size": "histogram",
    "lorapool_requests_running": "gauge",
    "lorapool_requests_waiting": "gauge",
    "lorapool_kv_cache_usage_ratio": "gauge",
    "lorapool_lora_adapter_loaded": "gauge",
    "lorapool_lora_requests_running": "gauge",
}
PER_REQUEST = [name for name, kind in TYPES.items() if kind == "histogram" and "batch" not in name]


@pytest.fixture(scope="module")
def engine(model):
    from lorapool.engine.config import EngineArgs
    from lorapool.engine.llm_engine import LLMEngine

    args = EngineArgs(model=model, max_num_seqs=8, enable_lora=True, max_loras=4, max_lora_rank=8)
    return LLMEngine.from_engine_args(args)


@pytest.fixture(scope="module")
def adapter_dirs(model, tmp_path_factory):
    from adapters import build_adapter

    root = tmp_path_factory.mktemp("metrics-adapters")
    return {
        name: build_adapter(model, root / name, rank=8, seed=i, std=0.2)
        for i, name in enumerate(["ad-a", "ad-b", "ad-c", "ad-d", "ad-e"])
    }


class Running:
    """A worker serving in a thread, its ``/metrics`` on a free port."""

    def __init__(self, engine, conn, keys, model, **metrics):
        options = dict(prefix=keys.prefix, shards=keys.shards, lease_s=5, metrics_port=0)
        config = WorkerConfig(**options, **metrics)
        self.worker = Worker(engine, conn, config, base_model_info(model))
        self.thread = threading.Thread(target=self.worker.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 10
        while self.worker.metrics.port is None and time.monotonic() < deadline:
            time.sleep(0.01)
        return self

    def __exit__(self, *exc):
        self.worker.stopped = True
        self.thread.join(timeout=30)

    def scrape(self) -> dict:
        url = f"http://127.0.0.1:{self.worker.metrics.port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as reply:
            text = reply.read().decode()
        return {family.name: family for family in text_string_to_metric_families(text)}


def samples(family, suffix: str = "") -> dict:
    """{labels as a sorted tuple: value} of the family's samples named ``name + suffix``."""
    wanted = family.name + suffix
    return {tuple(sorted(s.labels.items())): s.value for s in family.samples if s.name == wanted}


def by_adapter(family, suffix: str) -> dict:
    return {dict(k)["adapter"]: v for k, v in samples(family, suffix).items()}


def test_counts_histograms_and_labels_after_a_run(
    engine, conn, keys, producer, model, adapter_dirs
):
    for name in ("ad-a", "ad-b"):
        producer.registry.add(name, adapter_dirs[name])
    with Running(engine, conn, keys, model, metrics_vllm_names=True) as running:
        long = producer.submit("an aborted one", LONG)
        next(iter(long.stream(timeout=30)))  # it runs: a first chunk is in its log
        long.abort()
        jobs = {"ad-a": [], "ad-b": []}
        for i, adapter in enumerate(["ad-a", "ad-a", "ad-b", "ad-a", "ad-b"]):
            jobs[adapter].append(producer.submit(f"prompt {i}", SHORT, lora_request=adapter))
        results = {a: [h.result(timeout=60) for h in hs] for a, hs in jobs.items()}
        results["base"] = [long.result(timeout=60)]
        families = running.scrape()

    for name, kind in TYPES.items():
        assert families[name].type == kind, name
    assert samples(families["lorapool_requests"], "_total") == {
        (("adapter", "ad-a"), ("finish_reason", "length")): 3,
        (("adapter", "ad-b"), ("finish_reason", "length")): 2,
        (("adapter", "base"), ("finish_reason", "abort")): 1,
    }
    assert results["base"][0].outputs[0].finish_reason == "abort"
    tokens = {a: [len(r.outputs[0].token_ids) for r in rs] for a, rs in results.items()}
    assert tokens["ad-a"] == [6, 6, 6] and 0 < tokens["base"][0] < 400
    assert by_adapter(families["lorapool_generation_tokens"], "_total") == {
        a: sum(t) for a, t in tokens.items()
    }
    for name in PER_REQUEST:
        counts = by_adapter(families[name], "_count")
        expected = {"ad-a": 3, "ad-b": 2, "base": 1}
        if name == "lorapool_inter_token_latency_seconds":  # one token per step each
            expected = {a: sum(n - 1 for n in t) for a, t in tokens.items()}
        assert counts == expected, name
    gen = by_adapter(families["lorapool_request_generation_tokens"], "_sum")
    assert gen == {a: sum(t) for a, t in tokens.items()}
    steps = samples(families["lorapool_engine_steps"], "_total")[()]
    assert samples(families["lorapool_batch_size"], "_count")[()] == steps > 0
    assert _loaded(families) == {
        ("ad-a", "cpu"),
        ("ad-a", "device"),
        ("ad-b", "cpu"),
        ("ad-b", "device"),
    }
    assert samples(families["lorapool_requests_running"])[()] == 0
    assert samples(families["lorapool_lora_requests_running"]) == {}
    vllm = samples(families["vllm:num_requests_waiting"])
    assert list(vllm.values()) == [0] and dict(next(iter(vllm)))["model_name"]
    assert families["vllm:lora_requests_info"].type == "gauge"


def _loaded(families) -> set:
    family = families["lorapool_lora_adapter_loaded"]
    return {(dict(k)["adapter"], dict(k)["level"]) for k, v in samples(family).items() if v}


def test_adapter_series_stay_at_the_cap(engine, conn, keys, producer, model, adapter_dirs):
    names = sorted(adapter_dirs)
    for name in names:
        producer.registry.add(name, adapter_dirs[name])
    with Running(engine, conn, keys, model, metrics_max_adapters=3) as running:
        handles = [producer.submit(f"p {n}", SHORT, lora_request=n) for n in names]
        handles.append(producer.submit("base", SHORT))
        for h in handles:
            assert h.result(timeout=60).outputs[0].finish_reason == "length"
        families = running.scrape()
    label_sets = defaultdict(set)
    for family in families.values():
        for s in family.samples:
            if "adapter" in s.labels:
                label_sets[family.name].add(s.labels["adapter"])
    assert label_sets["lorapool_requests"] | label_sets["lorapool_lora_adapter_loaded"]
    for name, labels in label_sets.items():
        assert len(labels) <= 3 and "other" in labels, (name, labels)
    total = samples(families["lorapool_requests"], "_total")
    assert sum(total.values()) == len(names) + 1


VLLM_TYPES = {
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:num_preemptions": "counter",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:request_time_per_output_token_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_inference_time_seconds": "histogram",
    "vllm:request_prefill_time_seconds": "histogram",
    "vllm:request_decode_time_seconds": "histogram",
    "vllm:request_prompt_tokens": "histogram",
    "vllm:request_generation_tokens": "histogram",
    "vllm:iteration_tokens_total": "histogram",
    "vllm:request_params_n": "histogram",
    "vllm:request_params_max_tokens": "histogram",
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:lora_requests_info": "gauge",
    "vllm:cache_config_info": "gauge",
}


def test_vllm_names_beside_ours_and_no_created_series(
    engine, conn, keys, producer, model, adapter_dirs
):
    """vLLM's series, labelled model_name, agree with the jobs' own results and with
    lorapool's series of the same run; prometheus-client writes no _created line."""
    producer.registry.add("ad-a", adapter_dirs["ad-a"])
    base = base_model_info(model).name
    with Running(engine, conn, keys, model) as running:
        handles = [producer.submit(f"p {i}", SHORT, lora_request="ad-a") for i in range(3)]
        handles.append(producer.submit("two of them", SamplingParams(n=2, max_tokens=5)))
        results = [h.result(timeout=60) for h in handles]
        families = running.scrape()
        url = f"http://127.0.0.1:{running.worker.metrics.port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as reply:
            text = reply.read().decode()
    assert "_created" not in text
    for name, kind in VLLM_TYPES.items():
        assert families[name].type == kind, name
        for sample in families[name].samples:
            if kind != "gauge" or name.startswith("vllm:num_") or "usage" in name:
                assert sample.labels.get("model_name") == base, (name, sample.labels)
    generated = sum(len(c.token_ids) for r in results for c in r.outputs)
    prompts = sum(len(r.prompt_token_ids) for r in results)
    one = (("model_name", base),)
    assert samples(families["vllm:generation_tokens"], "_total") == {one: generated}
    assert samples(families["vllm:prompt_tokens"], "_total") == {one: prompts}
    reasons = {}
    for r in results:
        reason = r.outputs[0].finish_reason
        reasons[reason] = reasons.get(reason, 0) + 1
    got = samples(families["vllm:request_success"], "_total")
    assert {dict(k)["finished_reason"]: v for k, v in got.items() if v} == reasons
    ours = sum(samples(families["lorapool_requests"], "_total").values())
    assert sum(got.values()) == ours == len(handles)
    assert samples(families["vllm:request_params_n"], "_sum") == {one: 3 + 2}
    assert samples(families["vllm:request_generation_tokens"], "_sum") == {one: generated}
    iteration = samples(families["vllm:iteration_tokens_total"], "_sum")[one]
    hits = samples(families["vllm:prefix_cache_hits"], "_total")[one]
    sequences = sum(len(r.outputs) for r in results)
    # every prompt token not found in the cache ran once, and every generated token but
    # each sequence's last (sampled, never run)
    assert iteration == prompts - hits + generated - sequences
    for name in ("e2e_request_latency", "time_to_first_token", "request_queue_time"):
        count = samples(families[f"vllm:{name}_seconds"], "_count")[one]
        assert count == len(handles), name
    prefill = samples(families["vllm:request_prefill_time_seconds"], "_sum")[one]
    decode = samples(families["vllm:request_decode_time_seconds"], "_sum")[one]
    inference = samples(families["vllm:request_inference_time_seconds"], "_sum")[one]
    assert abs(prefill + decode - inference) < 1e-6
    cache = next(iter(families["vllm:cache_config_info"].samples)).labels
    assert cache["block_size"] == str(engine.args.block_size)
    assert int(cache["num_gpu_blocks"]) == engine.block_manager.num_blocks
