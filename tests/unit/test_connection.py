"""lorapool.connection: the client options every role shares (no server needed)."""

import asyncio
import time

import pytest
import redis
from redis_server import free_port

from lorapool.connection import LOOP_RETRIES, connect, connect_async


@pytest.mark.parametrize("url", ["redis://127.0.0.1:6379/0", "unix:///tmp/lorapool-none.sock"])
def test_options_make_a_connection(url):
    """A unix socket connection refuses TCP keepalive; the embedded Redis is one."""
    made = connect(url).connection_pool.make_connection()
    assert made.socket_timeout == 10.0 and made.retry.get_retries() == 6
    aio = connect_async(url)
    assert aio.connection_pool.make_connection().retry.get_retries() == 6
    asyncio.run(aio.aclose())


def test_keepalive_on_tcp_only():
    assert connect("redis://127.0.0.1:6379/0").connection_pool.connection_kwargs["socket_keepalive"]
    assert "socket_keepalive" not in connect("unix:///x.sock").connection_pool.connection_kwargs


def test_retries_are_bounded_and_logged(caplog):
    """A refused connection is retried with backoff (0.1-0.2 s, then 0.2-0.4 s), then raises;
    the first failed try is a warning, the others debug."""
    caplog.set_level("DEBUG", logger="lorapool.connection")
    client = connect(f"redis://127.0.0.1:{free_port()}/0", retries=LOOP_RETRIES)
    started = time.monotonic()
    with pytest.raises(redis.ConnectionError):
        client.ping()
    assert 0.3 <= time.monotonic() - started <= 1.0
    failed = [r for r in caplog.records if r.name == "lorapool.connection"]
    assert [r.levelname for r in failed] == ["WARNING"] + ["DEBUG"] * LOOP_RETRIES
    assert "Connection refused" in failed[0].getMessage()


def test_async_retries_are_logged(caplog):
    caplog.set_level("DEBUG", logger="lorapool.connection")

    async def ping():
        client = connect_async(f"redis://127.0.0.1:{free_port()}/0", retries=1)
        try:
            with pytest.raises(redis.ConnectionError):
                await client.ping()
        finally:
            await client.aclose()

    asyncio.run(ping())
    assert len([r for r in caplog.records if r.name == "lorapool.connection"]) == 2
