"""Redis clients that ride out a stall or a restart: one set of options for every role.

Workers, producers and the audit writer connect through ``connect`` (sync) or
``connect_async``: redis-py retries a command that failed on a broken
connection (ConnectionError, TimeoutError, a server still loading its AOF)
with exponential backoff, reconnecting each time; a health check pings a
connection idle for ``health_check_interval`` seconds before reuse; TCP
keepalive notices a peer that vanished. What outlasts the retries (an outage
of more than a few seconds) reaches the caller, whose loop backs off and goes
on: see ``Worker.run`` and ``AuditWriter.run``.
"""

from __future__ import annotations

from typing import Any

import redis
from redis.backoff import ExponentialBackoff

# Redis away (a stall, a restart): loops ride these out; other errors are the caller's.
REDIS_DOWN = (redis.ConnectionError, redis.TimeoutError)
SOCKET_TIMEOUT_S = 10.0  # above every blocking read's BLOCK (worker 0.1 s, client 1 s)
RETRIES = 3


def connection_options(retry_class: type = redis.retry.Retry) -> dict[str, Any]:
    """Keyword arguments of ``Redis.from_url`` shared by all of lorapool's clients."""
    return {
        "retry": retry_class(ExponentialBackoff(cap=2.0, base=0.05), RETRIES),
        "retry_on_error": [redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError],
        "health_check_interval": 10,
        "socket_keepalive": True,
        "socket_timeout": SOCKET_TIMEOUT_S,
        "socket_connect_timeout": 5.0,
    }


def connect(url: str, **overrides: Any) -> redis.Redis:
    """A client of ``url`` with lorapool's retry, health-check and timeout options."""
    return redis.Redis.from_url(url, **{**connection_options(), **overrides})


def connect_async(url: str, **overrides: Any):
    """The asyncio client of ``url`` with the same options."""
    from redis.asyncio import Redis
    from redis.asyncio.retry import Retry

    return Redis.from_url(url, **{**connection_options(Retry), **overrides})


def ensure_group(connection: redis.Redis, stream: str, group: str) -> None:
    """Create ``group`` on ``stream`` (and the stream), reading from its start, unless it exists."""
    try:
        connection.xgroup_create(stream, group, id="0", mkstream=True)
    except redis.ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise
