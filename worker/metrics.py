"""A worker's Prometheus metrics, served on ``--metrics-port``.

vLLM's series (``vllm:*``, labelled ``model_name``) are exported beside ours
(``vllm_metrics.py``); no ``_created`` series.

The worker calls ``WorkerMetrics`` at four points, all on its own thread:
``admitted`` (a request entered the engine), ``stepped`` (an engine step's
outputs), ``failed`` (a request dead-lettered) and ``serve``/``close``. The
HTTP thread of prometheus-client only reads: counters and histograms (which
lock), and a snapshot of the engine's state that the worker's thread replaces
whole (``_Snapshot``), so a scrape never touches the engine or ``WorkerState.held``.

Adapter labels are capped (``AdapterLabels``): the first ``max_series - 1``
adapter names seen keep their own label, every later one is ``other``, so any
number of adapters costs a bounded number of series per metric.
"""

from __future__ import annotations

import time
from collections import Counter as Tally
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    start_http_server,
)
from prometheus_client.core import GaugeMetricFamily

from lorapool.outputs import RequestOutput
from lorapool.records.adapter import ModelIdentity
from lorapool.worker.vllm_metrics import VllmMetrics, vllm_gauges

if TYPE_CHECKING:
    from lorapool.worker.config import WorkerConfig
    from lorapool.worker.engine_api import EngineInterface
    from lorapool.worker.held import Held

BASE = "base"  # the label of requests without an adapter
OTHER = "other"  # the label of adapters past the cap
REFRESH_S = 0.25  # the engine-state snapshot is taken at most this often while busy
SECONDS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0)
SECONDS += (7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TOKENS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)
BATCH = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


class AdapterLabels:
    """Adapter name -> label value, at most ``max_series`` values (``other`` included)."""

    def __init__(self, max_series: int):
        if max_series < 2:
            raise ValueError(f"the adapter series cap must be >= 2, got {max_series}")
        self.max_series = max_series
        self._own: set[str] = set()

    def __call__(self, name: str | None) -> str:
        name = BASE if name is None else name
        if name in self._own:
            return name
        if len(self._own) < self.max_series - 1:
            self._own.add(name)
            return name
        return OTHER


@dataclass
class _Snapshot:
    """The engine's state as last seen by the worker's thread (replaced, never mutated)."""

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    loaded: dict[str, Tally] = field(default_factory=dict)  # level -> label -> adapters
    lora_running: Tally = field(default_factory=Tally)  # label -> requests
    lora_waiting: Tally = field(default_factory=Tally)
    max_loras: int = 0
    taken: float = 0.0  # time.time()


def _lora_name(out: RequestOutput) -> str | None:
    return None if out.lora_request is None else out.lora_request.lora_name


class WorkerMetrics:
    """Counters, histograms and gauges of one worker, in a registry of its own."""

    def __init__(self, config: WorkerConfig, engine: EngineInterface, model: str):
        self.config, self.engine, self.model = config, engine, model
        self.labels = AdapterLabels(config.metrics_max_adapters)
        disable_created_metrics()  # no _created series (vLLM's and Prometheus' advice)
        self.registry = CollectorRegistry(auto_describe=True)
        self.vllm = VllmMetrics(self.registry, model)
        self.cache_config = engine.cache_config()
        self._live: dict[str, str] = {}  # request id -> label, while in the engine
        self._last_token: dict[str, float] = {}  # request id -> time of its latest token
        self.snapshot = _Snapshot()
        self._device: set[str] = set()  # adapter names in device slots at the last snapshot
        self._server = None
        self._define()
        self.registry.register(_StateCollector(self))

    def _define(self) -> None:
        reg, adapter = self.registry, ["adapter"]

        def hist(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, adapter, registry=reg, buckets=buckets)

        self.queue_time = hist(
            "lorapool_request_queue_time_seconds", "arrival to first scheduled", SECONDS
        )
        self.ttft = hist("lorapool_time_to_first_token_seconds", "arrival to first token", SECONDS)
        self.itl = hist(
            "lorapool_inter_token_latency_seconds", "between a request's steps with tokens", SECONDS
        )
        self.e2e = hist("lorapool_e2e_request_latency_seconds", "arrival to finish", SECONDS)
        self.prompt_tokens = hist(
            "lorapool_request_prompt_tokens", "prompt tokens per request", TOKENS
        )
        self.gen_tokens = hist(
            "lorapool_request_generation_tokens", "generated tokens per request", TOKENS
        )
        self.requests = Counter(
            "lorapool_requests", "finished requests", ["adapter", "finish_reason"], registry=reg
        )
        self.tokens = Counter(
            "lorapool_generation_tokens", "tokens generated", adapter, registry=reg
        )
        self.steps = Counter("lorapool_engine_steps", "engine steps run", registry=reg)
        self.batch = Histogram(
            "lorapool_batch_size", "requests a step advanced", registry=reg, buckets=BATCH
        )
        self.loads = Counter(
            "lorapool_lora_adapter_loads", "adapters put into a device slot", registry=reg
        )
        self.evictions = Counter(
            "lorapool_lora_adapter_evictions", "adapters taken out of a device slot", registry=reg
        )

    # --- the worker's hooks ------------------------------------------------------

    def serve(self) -> None:
        """Serve ``/metrics`` on ``config.metrics_port`` (0: a free port, see ``port``)."""
        if self.config.metrics_port is not None and self._server is None:
            self._server, _ = start_http_server(
                self.config.metrics_port, self.config.metrics_addr, self.registry
            )

    @property
    def port(self) -> int | None:
        return None if self._server is None else self._server.server_port

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def admitted(self, held: Held) -> None:
        """A request entered the engine."""
        lora = held.job.lora_request
        self._live[held.request_id] = self.labels(None if lora is None else lora.lora_name)
        self.vllm.admitted(held.job.sampling_params)

    def stepped(self, outputs: list[RequestOutput], held: dict[str, Held]) -> None:
        """One engine step's outputs: token counts and latencies, finished requests
        (those still ``held``: a request lost to another worker is not counted here)."""
        now = time.time()
        self.steps.inc()
        self.batch.observe(len(outputs))
        self.vllm.stepped(self.engine.step_stats())
        for out in outputs:
            label = self._live.get(out.request_id) or self.labels(_lora_name(out))
            new = sum(len(c.token_ids) for c in out.outputs)
            if new:
                self._token(out.request_id, label, new, now)
            if out.finished:
                self._finished(out, label, out.request_id in held)
        if not self.engine.has_unfinished_requests() or now - self.snapshot.taken > REFRESH_S:
            self.snapshot = self._take_snapshot(now)

    def failed(self, held: Held | None) -> None:
        """A request dead-lettered (its error output written by the worker, not the engine)."""
        lora = None if held is None else held.job.lora_request
        name = "unknown" if held is None else (None if lora is None else lora.lora_name)
        self.requests.labels(self.labels(name), "error").inc()
        self.vllm.failed()

    # --- what the hooks record ---------------------------------------------------

    def _token(self, request_id: str, label: str, new: int, now: float) -> None:
        self.tokens.labels(label).inc(new)
        last = self._last_token.get(request_id)
        if last is not None:
            self.itl.labels(label).observe(now - last)
        self.vllm.tokens(new, None if last is None else now - last)
        self._last_token[request_id] = now

    def _finished(self, out: RequestOutput, label: str, counted: bool) -> None:
        self._live.pop(out.request_id, None)
        self._last_token.pop(out.request_id, None)
        if not counted:
            return
        reason = out.outputs[0].finish_reason if out.outputs else None
        self.requests.labels(label, reason or "unknown").inc()
        self.vllm.finished(out, reason or "unknown", time.time())
        m = out.metrics
        if m is None:
            return
        for histogram, value in (
            (self.queue_time, m.time_in_queue),
            (self.ttft, m.first_token_time and m.first_token_time - m.arrival_time),
            (self.e2e, (m.finished_time or time.time()) - m.arrival_time),
        ):
            if value is not None:
                histogram.labels(label).observe(max(0.0, value))
        self.prompt_tokens.labels(label).observe(m.num_prompt_tokens)
        self.gen_tokens.labels(label).observe(m.num_generated_tokens)

    def _take_snapshot(self, now: float) -> _Snapshot:
        engine = self.engine
        running, waiting = engine.request_counts()
        kv = engine.kv_cache_usage() or 0.0
        lora = engine.lora_state()
        self._count_loads(lora.get("device", []))
        ids = engine.running_request_ids()
        return _Snapshot(
            running=running,
            waiting=waiting,
            kv_usage=kv,
            loaded={lvl: Tally(map(self.labels, lora.get(lvl, []))) for lvl in ("device", "cpu")},
            lora_running=Tally(label for rid, label in self._live.items() if rid in ids),
            lora_waiting=Tally(label for rid, label in self._live.items() if rid not in ids),
            max_loras=lora.get("max_loras", 0),
            taken=now,
        )

    def _count_loads(self, device: list[str]) -> None:
        """Loads and evictions seen between snapshots (one swapped out and back in
        between two snapshots is not seen)."""
        before, self._device = self._device, set(device)
        self.loads.inc(len(self._device - before))
        self.evictions.inc(len(before - self._device))


class _StateCollector:
    """The engine-state gauges, from the latest snapshot (read on the scrape's thread)."""

    def __init__(self, metrics: WorkerMetrics):
        self.metrics = metrics

    def collect(self):
        s, m = self.metrics.snapshot, self.metrics
        yield _gauge("lorapool_requests_running", "requests in the running batch", s.running)
        yield _gauge("lorapool_requests_waiting", "requests waiting for a batch slot", s.waiting)
        yield _gauge("lorapool_kv_cache_usage_ratio", "share of KV-cache blocks in use", s.kv_usage)
        loaded = GaugeMetricFamily(
            "lorapool_lora_adapter_loaded", "adapters loaded", labels=["adapter", "level"]
        )
        for level, tally in s.loaded.items():
            for label, n in tally.items():
                loaded.add_metric([label, level], n)
        yield loaded
        running = GaugeMetricFamily(
            "lorapool_lora_requests_running", "running requests per adapter", labels=["adapter"]
        )
        for label, n in s.lora_running.items():
            running.add_metric([label], n)
        yield running
        yield from vllm_gauges(s, m.model, m.cache_config)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


class NoMetrics:
    """The hooks of a worker without ``--metrics-port``: nothing recorded."""

    port = None

    def serve(self) -> None: ...
    def close(self) -> None: ...
    def admitted(self, held) -> None: ...
    def stepped(self, outputs, held) -> None: ...
    def failed(self, held) -> None: ...


def worker_metrics(config: WorkerConfig, engine, base_model: ModelIdentity):
    """The worker's metrics: recorded only when it serves them (``metrics_port`` set)."""
    if config.metrics_port is None:
        return NoMetrics()
    return WorkerMetrics(config, engine, base_model.name)
