"""``until_outage`` (gateway/redis_watch.py), the wrapper of every stream the gateway
relays: it reads at most ``BUFFERED`` items ahead of a slow client, and its outage
verdict still reaches a client whose buffer was full when Redis went away. A real
RedisWatch whose Redis is a closed port; the oracle is what the source yielded against
what the client took, and the error the client gets."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest

from lorapool.gateway.redis_watch import BUFFERED, RedisWatch, until_outage
from lorapool.lifecycle.marker import RedisAway
from lorapool.tasks import cancel_and_wait


def _watch() -> RedisWatch:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return RedisWatch(f"redis://127.0.0.1:{port}/0")


def test_a_slow_client_holds_at_most_the_buffer_not_the_whole_stream():
    async def run():
        watch, made = _watch(), [0]

        async def source():  # a stream of 5,000 chunks, all available at once
            for i in range(5000):
                made[0] += 1
                yield i
                await asyncio.sleep(0)

        taken, ahead = [], 0
        async for item in until_outage(source(), watch, 30.0):
            taken.append(item)
            if len(taken) % 100 == 0:
                await asyncio.sleep(0.01)  # the client reads slowly: the source runs on
                ahead = max(ahead, made[0] - len(taken))
        await watch.close()
        return taken, ahead

    taken, ahead = asyncio.run(run())
    assert taken == list(range(5000))  # every item, in order
    assert ahead <= BUFFERED + 1  # what the pump read ahead of the client


def test_the_outage_reaches_a_client_whose_buffer_was_full():
    async def run():
        watch = _watch()

        async def source():  # BUFFERED items at once, then a Redis read that never ends
            for i in range(BUFFERED + 10):
                yield i
            await asyncio.Event().wait()

        stream = until_outage(source(), watch, 0.5)
        taken = [await anext(stream)]
        await asyncio.sleep(0.1)  # the pump fills the buffer and waits on the put
        watching = asyncio.ensure_future(watch.run())  # its pings fail: Redis is away
        start = time.monotonic()
        try:
            with pytest.raises(RedisAway) as caught:
                async for item in stream:
                    taken.append(item)
        finally:
            await cancel_and_wait(watching)  # its wait_for may swallow one cancel
            await watch.close()
        return taken, caught.value, time.monotonic() - start

    taken, error, waited = asyncio.run(run())
    assert taken == list(range(BUFFERED + 10))  # what was read before Redis went away
    assert error.seconds == 0.5 and "has not answered for 0.5s" in str(error)
    assert waited < 5  # the watch's 0.5 s verdict, noticed within its pings
