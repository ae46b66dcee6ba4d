"""The gateway's own HTTP metrics, served with the pool's gauges on ``/metrics``.

- ``http_requests_total{handler, method, status}``: requests answered, by the route's
  template (``/v1/jobs/{job_id}``; ``other`` for paths no route matched, so a scanner
  cannot mint series) and the status code;
- ``http_request_duration_seconds{handler, method, status}``: from the request to the
  end of its response (a stream's whole length);
- ``lorapool_gateway_rate_limited_total{tenant}``: 429s by tenant, at most
  ``MAX_TENANTS`` tenant series (later tenants count as ``other``).

The names and labels are those prometheus-fastapi-instrumentator gives vLLM's server,
so boards made for it read these. The gateway's edge (``edge.py``) records every
request.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics

MAX_TENANTS = 50
OTHER = "other"
SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
SECONDS += (300.0, 600.0)


class HttpMetrics:
    """The counters and histogram, in a registry of their own (``collect`` yields them)."""

    def __init__(self, max_tenants: int = MAX_TENANTS):
        disable_created_metrics()
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ["handler", "method", "status"]
        registry = self.registry
        self.requests = Counter("http_requests", "requests answered", labels, registry=registry)
        self.duration = Histogram(
            "http_request_duration_seconds",
            "request to the end of its response",
            labels,
            registry=self.registry,
            buckets=SECONDS,
        )
        self.limited = Counter(
            "lorapool_gateway_rate_limited",
            "requests answered 429, by tenant",
            ["tenant"],
            registry=self.registry,
        )
        self.max_tenants = max_tenants
        self._tenants: set[str] = set()
        self._children: dict[tuple, tuple] = {}  # (handler, method, status) -> its series

    def collect(self):
        return self.registry.collect()

    def observe(self, handler: str, method: str, status: int, seconds: float, tenant) -> None:
        key = (handler, method, status)
        series = self._children.get(key)
        if series is None:  # labels() looks the series up under a lock: 28.6 us a request
            labels = (handler, method, str(status))
            series = self._children[key] = (
                self.requests.labels(*labels),
                self.duration.labels(*labels),
            )
        series[0].inc()
        series[1].observe(seconds)
        if status == 429:
            self.limited.labels(self._tenant(tenant)).inc()

    def _tenant(self, tenant: str | None) -> str:
        name = tenant or "-"
        if name in self._tenants:
            return name
        if len(self._tenants) < self.max_tenants - 1:
            self._tenants.add(name)
            return name
        return OTHER
