"""A worker's metrics under vLLM's names, beside lorapool's own (``metrics.py``).

The series vLLM's engine exports (v1, ``vllm/v1/metrics/loggers.py``), labelled
``model_name`` (the pool's base model), so its Grafana boards and LoRA-aware routers
read a lorapool worker as they read a vLLM server: request, token, latency, cache and
LoRA metrics. Recorded from the same hooks as ours, on the worker's thread; the gauges
come from the snapshot ``metrics.py`` takes.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily

from lorapool.outputs import RequestOutput
from lorapool.protocol import SamplingParams

# vLLM's buckets
TTFT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5)
TTFT += (10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
ITL += (20.0, 40.0, 80.0)
REQUEST = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0)
REQUEST += (120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TOKENS = tuple(m * 10**e for e in range(6) for m in (1, 2, 5))  # 1, 2, 5, 10, ... 500,000
N = (1, 2, 5, 10, 20)


class VllmMetrics:
    """vLLM's counters and histograms in ``registry``, for one base model."""

    def __init__(self, registry: CollectorRegistry, model: str):
        self.model = model
        label = ["model_name"]

        def counter(name: str, doc: str, extra=()) -> Counter:
            return Counter(f"vllm:{name}", doc, [*label, *extra], registry=registry)

        def hist(name: str, doc: str, buckets) -> Histogram:
            return Histogram(f"vllm:{name}", doc, label, registry=registry, buckets=buckets)

        self.prompt_tokens = counter("prompt_tokens", "prefill tokens processed")
        self.generation_tokens = counter("generation_tokens", "generation tokens processed")
        self.success = counter("request_success", "finished requests", ["finished_reason"])
        self.preemptions = counter("num_preemptions", "preemptions of the engine")
        self.cache_queries = counter("prefix_cache_queries", "prompt tokens looked up")
        self.cache_hits = counter("prefix_cache_hits", "prompt tokens found in the cache")
        self.ttft = hist("time_to_first_token_seconds", "time to first token", TTFT)
        self.itl = hist("inter_token_latency_seconds", "inter-token latency", ITL)
        self.tpot = hist(
            "request_time_per_output_token_seconds", "time per output token of a request", ITL
        )
        self.e2e = hist("e2e_request_latency_seconds", "end-to-end request latency", REQUEST)
        self.queue = hist("request_queue_time_seconds", "time in the waiting queue", REQUEST)
        self.inference = hist("request_inference_time_seconds", "time running", REQUEST)
        self.prefill = hist("request_prefill_time_seconds", "time in prefill", REQUEST)
        self.decode = hist("request_decode_time_seconds", "time in decode", REQUEST)
        self.request_prompt = hist("request_prompt_tokens", "prompt tokens a request", TOKENS)
        self.request_generation = hist(
            "request_generation_tokens", "generated tokens a request", TOKENS
        )
        self.iteration = hist("iteration_tokens_total", "tokens an engine step", TOKENS)
        self.params_n = hist("request_params_n", "the n of a request", N)
        self.params_max_tokens = hist("request_params_max_tokens", "max_tokens a request", TOKENS)
        self._preemptions_seen = 0
        for metric in vars(self).values():  # every series exists from the start, at 0
            if isinstance(metric, (Counter, Histogram)) and metric is not self.success:
                metric.labels(model)
        for reason in ("stop", "length", "abort", "error"):
            self.success.labels(model, reason)

    def admitted(self, params: SamplingParams) -> None:
        self.params_n.labels(self.model).observe(params.n)
        if params.max_tokens is not None:
            self.params_max_tokens.labels(self.model).observe(params.max_tokens)

    def tokens(self, new: int, since_last: float | None) -> None:
        self.generation_tokens.labels(self.model).inc(new)
        if since_last is not None:
            self.itl.labels(self.model).observe(since_last)

    def stepped(self, stats: dict[str, int]) -> None:
        """An engine step's ``step_stats`` (tokens it ran, preemptions so far)."""
        if stats.get("num_step_tokens"):
            self.iteration.labels(self.model).observe(stats["num_step_tokens"])
        preemptions = stats.get("num_preemptions", self._preemptions_seen)
        if preemptions > self._preemptions_seen:
            self.preemptions.labels(self.model).inc(preemptions - self._preemptions_seen)
        self._preemptions_seen = preemptions

    def failed(self) -> None:
        self.success.labels(self.model, "error").inc()

    def finished(self, out: RequestOutput, reason: str, now: float) -> None:
        """A finished request: its reason, tokens and the latencies of its metrics."""
        model = self.model
        self.success.labels(model, reason).inc()
        m = out.metrics
        if m is None:
            return
        self.prompt_tokens.labels(model).inc(m.num_prompt_tokens)
        self.cache_queries.labels(model).inc(m.num_prompt_tokens)
        self.cache_hits.labels(model).inc(m.num_cached_tokens or 0)
        self.request_prompt.labels(model).observe(m.num_prompt_tokens)
        self.request_generation.labels(model).observe(m.num_generated_tokens)
        finished = m.finished_time or now
        for histogram, value in _latencies(m, finished).items():
            if value is not None:
                getattr(self, histogram).labels(model).observe(max(0.0, value))


def _latencies(m, finished: float) -> dict[str, float | None]:
    scheduled, first = m.first_scheduled_time, m.first_token_time
    decode = None if first is None else finished - first
    tokens = m.num_generated_tokens
    return {
        "e2e": finished - m.arrival_time,
        "queue": m.time_in_queue,
        "ttft": None if first is None else first - m.arrival_time,
        "inference": None if scheduled is None else finished - scheduled,
        "prefill": None if scheduled is None or first is None else first - scheduled,
        "decode": decode,
        "tpot": None if decode is None or tokens < 2 else decode / (tokens - 1),
    }


def vllm_gauges(snapshot: Any, model: str, cache: dict[str, Any] | None):
    """vLLM's gauges from the worker's latest snapshot (``metrics._Snapshot``)."""
    for name, value in (("running", snapshot.running), ("waiting", snapshot.waiting)):
        family = GaugeMetricFamily(
            f"vllm:num_requests_{name}", f"requests {name}", labels=["model_name"]
        )
        family.add_metric([model], value)
        yield family
    usage = GaugeMetricFamily("vllm:kv_cache_usage_perc", "KV-cache usage", labels=["model_name"])
    usage.add_metric([model], snapshot.kv_usage)
    yield usage
    info = GaugeMetricFamily(
        "vllm:lora_requests_info",
        "running and waiting adapters",
        labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"],
    )
    running, waiting = sorted(snapshot.lora_running), sorted(snapshot.lora_waiting)
    info.add_metric([",".join(running), ",".join(waiting), str(snapshot.max_loras)], snapshot.taken)
    yield info
    if cache:
        names = sorted(cache)
        config = GaugeMetricFamily(
            "vllm:cache_config_info", "the KV cache's configuration", labels=names
        )
        config.add_metric([str(cache[k]) for k in names], 1.0)
        yield config
