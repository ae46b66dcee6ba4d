"""One APPEND call's cost per item, worker and Redis, without an engine or a worker loop.

``--items`` entries are queued and delivered to consumer ``w``; then ``--trips``
APPEND calls each append one chunk (``--payload`` bytes, a 2-token compact chunk by
default) to every entry's log, as a busy worker's round trip does. Reported per item:
the client's CPU (building the call, redis-py packing it, reading the reply) and
Redis's (``INFO cpu``). Run it against a Redis of its own: it flushes the database.
To compare two versions of the script, run it on each checkout, alternating.

    lorapool bench append_call [--items 256] [--trips 150] [--redis-url URL]
"""

from __future__ import annotations

import argparse
import json
import time

PAYLOAD = b'{"s":1,"o":31,"c":[{"t":" t12345 t23456","k":[12345,23456]}]}'


def measure(url: str, items: int, trips: int, payload: bytes) -> dict:
    import redis

    from lorapool.lifecycle.append import Append, Appender
    from lorapool.lifecycle.keys import WORKERS_GROUP, Keys

    conn = redis.Redis.from_url(url)
    conn.flushdb()
    keys = Keys("bench-append")
    conn.xgroup_create(keys.requests, WORKERS_GROUP, id="0", mkstream=True)
    ids = [conn.xadd(keys.requests, {"data": b"x"}).decode() for _ in range(items)]
    conn.xreadgroup(WORKERS_GROUP, "w", {keys.requests: ">"}, count=items)
    append = Appender(conn)

    def redis_cpu() -> float:
        info = conn.info("cpu")
        return info["used_cpu_sys"] + info["used_cpu_user"]

    cpu0, client0 = redis_cpu(), time.process_time()
    for seq in range(trips):
        calls = [Append(f"r{j}", ids[j], seq, payload, False) for j in range(items)]
        results = append(keys, "w", 1000, 60, calls)
        assert results == [0] * items, results[:4]
    cpu1, client1 = redis_cpu(), time.process_time()
    conn.flushdb()
    n = items * trips
    return {
        "items": items,
        "trips": trips,
        "client_cpu_us_per_item": round(1e6 * (client1 - client0) / n, 2),
        "redis_cpu_us_per_item": round(1e6 * (cpu1 - cpu0) / n, 2),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=256)
    parser.add_argument("--trips", type=int, default=150)
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6390/0")
    args = parser.parse_args(argv)
    result = measure(args.redis_url, args.items, args.trips, PAYLOAD)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
