"""A batch's lines count against its owner's limits: each line is taken from the rate
limits of the key that made the batch (``lorapool/lifecycle/rate_limits.py``, the same GCRA
state its interactive requests use) before it is submitted, one request and its
``max_tokens x n`` tokens; past them, submission waits until the limits allow it. So
a key at its ``--rpm`` gets its batch lines at that rate, and a batch leaves the key's
other requests only what the limits leave. A line that could never pass (over the
tokens per minute alone, or no ``max_tokens`` under a token limit) fails validation.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import orjson

from lorapool.batch.lines import BatchLine, LineError
from lorapool.lifecycle.keys import Keys
from lorapool.lifecycle.rate_limits import RateLimiter

logger = logging.getLogger(__name__)
MAX_WAIT_S = 1.0  # a paced submission looks at the batch's status at least this often


class Pacer:
    """The limits of a batch's owner (from its key's record now; none without a key)."""

    def __init__(self, connection, keys: Keys, owner: dict[str, Any]):
        self.tenant = owner.get("tenant")
        raw = connection.hget(keys.api_keys, owner["key_id"]) if owner.get("key_id") else None
        record = orjson.loads(raw) if raw else {}
        self.rpm, self.tpm = record.get("rpm"), record.get("tpm")
        limited = self.tenant is not None and (self.rpm or self.tpm)
        self.limiter = RateLimiter(connection, keys) if limited else None

    def tokens(self, line: BatchLine) -> int:
        params = line.parsed.params
        return params.n * (params.max_tokens or 0)

    def check(self, line: BatchLine) -> None:
        """LineError for a line these limits could never let through."""
        if self.tpm is None:
            return
        if line.parsed.params.max_tokens is None:
            raise LineError("max_tokens is required under a token rate limit", "body.max_tokens")
        if self.tokens(line) > self.tpm:
            raise LineError(
                f"max_tokens x n ({self.tokens(line)}) is over the key's {self.tpm} tokens "
                "per minute",
                "body.max_tokens",
            )

    def admit(self, line: BatchLine, stopped: Callable[[], bool]) -> bool:
        """Take ``line`` from the limits, waiting while they are spent; False when
        ``stopped()`` says the batch stopped meanwhile."""
        if self.limiter is None:
            return True
        while True:
            state = self.limiter.take(self.tenant, self.rpm, self.tpm, 1, self.tokens(line))
            if state.taken:
                return True
            if stopped():
                return False
            time.sleep(min(MAX_WAIT_S, state.wait_s))
