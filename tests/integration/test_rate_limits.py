"""Tenants' rate limits (GCRA) on a real Redis: the burst, the pace after it, no window
boundary that lets twice the limit through, both resources taken together or not at
all, exact under concurrent takers, and OpenAI's header values."""

from __future__ import annotations

import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from lorapool.connection import connect
from lorapool.lifecycle.keys import Keys
from lorapool.lifecycle.rate_limits import RateLimiter, duration

pytestmark = pytest.mark.integration


@pytest.fixture
def limiter(redis_url):
    keys = Keys(f"test-rate-{uuid.uuid4().hex[:8]}")
    connection = connect(redis_url)
    yield RateLimiter(connection, keys)
    for key in connection.scan_iter(f"{keys.prefix}:*"):
        connection.delete(key)
    connection.close()


def test_a_burst_of_the_limit_then_one_every_interval(limiter):
    taken = [limiter.take("t", 10, None, 1, 0) for _ in range(12)]
    assert [s.taken for s in taken] == [True] * 10 + [False] * 2
    assert [s.requests_left for s in taken[:10]] == list(range(9, -1, -1))
    refused = taken[10]
    assert 5.5 < refused.wait_s <= 6.0  # one request every 60/10 s
    assert refused.headers()["Retry-After"] == "6"
    assert 59 < taken[9].requests_reset_s <= 60  # full again a minute after the burst


def test_no_window_boundary_lets_twice_the_limit_through(limiter):
    """Row 12 of issue 32: --rpm 10, 10 requests and then 10 more 3.6 s later (a fixed
    window let all 20 through across a minute's end): GCRA takes no more than one of
    the second 10, wherever the minute's end falls."""
    first = sum(limiter.take("t", 10, None, 1, 0).taken for _ in range(10))
    time.sleep(3.6)
    second = sum(limiter.take("t", 10, None, 1, 0).taken for _ in range(10))
    assert first == 10 and second == 0


def test_requests_and_tokens_are_taken_together_or_not_at_all(limiter):
    assert limiter.take("t", 5, 100, 1, 90).taken
    refused = limiter.take("t", 5, 100, 1, 20)  # tokens would pass the limit
    assert not refused.taken and refused.requests_left == 4  # no request was taken
    assert limiter.take("t", 5, 100, 1, 10).taken
    state = limiter.take("t", 5, 100, 1, 0)
    assert state.taken and state.requests_left == 2 and state.tokens_left == 0


def test_tenants_do_not_share_limits(limiter):
    for _ in range(3):
        assert limiter.take("a", 3, None, 1, 0).taken
    assert not limiter.take("a", 3, None, 1, 0).taken
    assert limiter.take("b", 3, None, 1, 0).taken


def test_concurrent_takers_get_exactly_the_limit(limiter):
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda _: limiter.take("t", 20, None, 1, 0).taken, range(60)))
    assert sum(results) == 20


def test_headers_are_openais():
    assert duration(0.02) == "20ms" and duration(1.5) == "1.5s" and duration(360) == "6m0s"
    assert duration(61.25) == "1m1.25s" and duration(-1) == "0ms"


def test_headers_of_a_take(limiter):
    headers = limiter.take("t", 60, 1000, 1, 100).headers()
    assert headers["x-ratelimit-limit-requests"] == "60"
    assert headers["x-ratelimit-remaining-requests"] == "59"
    assert headers["x-ratelimit-reset-requests"] in ("1s", "999ms", "998ms")
    assert headers["x-ratelimit-limit-tokens"] == "1000"
    assert headers["x-ratelimit-remaining-tokens"] == "900"
    assert headers["x-ratelimit-reset-tokens"].endswith("s")
    assert "Retry-After" not in headers
