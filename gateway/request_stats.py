"""What this gateway answered lately, for the dashboard: each ``/v1/`` request's status,
its time to the first byte of the answer (a stream's: about its first token) and to the
last, kept for ``WINDOW_S`` (at most ``MAX_KEPT``), as the gateway's edge (``edge.py``)
records them."""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

WINDOW_S = 900.0
MAX_KEPT = 20_000


def percentile(values: list[float], q: float) -> float | None:
    """The nearest-rank q-th percentile (0..100); None without values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


@dataclass
class RequestStats:
    """(time, status, seconds to first byte, seconds in all) of recent requests."""

    kept: deque = field(default_factory=lambda: deque(maxlen=MAX_KEPT))

    def add(self, status: int, first_s: float, total_s: float) -> None:
        self.kept.append((time.time(), status, first_s, total_s))

    def summary(self, now: float | None = None) -> dict[str, Any]:
        """Counts by outcome and latency percentiles of the last ``WINDOW_S``."""
        since = (time.time() if now is None else now) - WINDOW_S
        recent = [r for r in self.kept if r[0] >= since]
        ok = [r for r in recent if r[1] < 400]
        first, total = [r[2] for r in ok], [r[3] for r in ok]
        return {
            "requests": len(recent),
            "client_errors": sum(400 <= r[1] < 500 for r in recent),
            "server_errors": sum(r[1] >= 500 for r in recent),
            "first_byte": {q: percentile(first, q) for q in (50, 90, 99)},
            "total": {q: percentile(total, q) for q in (50, 90, 99)},
        }
