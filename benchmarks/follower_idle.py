"""What a quiet follower costs: an ``AsyncProducer`` following ``--requests`` queued jobs
that no worker runs (so nothing arrives), its process's CPU over ``--seconds`` after a
``--settle`` wait, as a share of one core. Its listener's reads while subscribed
(``LISTEN_S``) and the jobs' log polls are what it spends.

    lorapool bench follower_idle [--listen-s 0.005] [--requests 50] [--seconds 8]
                                 [--redis-url redis+cluster://127.0.0.1:7000/0 --shards 3]

Redis: ``--redis-url``, else ``$REDIS_URL``, else 127.0.0.1:6379/0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
import uuid


async def measure(args) -> float:
    from lorapool.lifecycle import follower
    from lorapool.producer import AsyncProducer
    from lorapool.protocol import SamplingParams

    if args.listen_s is not None:
        follower.LISTEN_S = args.listen_s
    prefix = f"bench-follower-idle-{uuid.uuid4().hex[:8]}"
    producer = AsyncProducer(args.redis_url, prefix=prefix, shards=args.shards)
    try:
        handles = await producer.submit_many(
            [{"prompt_token_ids": [1, 2]}] * args.requests,
            [SamplingParams(max_tokens=2)] * args.requests,
        )
        waits = [asyncio.create_task(h.result(timeout=3600)) for h in handles]
        await asyncio.sleep(args.settle)
        cpu, wall = time.process_time(), time.monotonic()
        await asyncio.sleep(args.seconds)
        share = (time.process_time() - cpu) / (time.monotonic() - wall)
        for wait in waits:
            wait.cancel()
        await asyncio.gather(*waits, return_exceptions=True)
    finally:
        async for key in producer.redis.scan_iter(match=f"*{prefix}*", count=1000):
            await producer.redis.delete(key)
        await producer.aclose()
    return share


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--redis-url", default=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
    )
    parser.add_argument("--shards", type=int, default=0)
    parser.add_argument("--listen-s", type=float, default=None, help="default: the code's")
    parser.add_argument("--requests", type=int, default=50)
    parser.add_argument("--settle", type=float, default=2.0)
    parser.add_argument("--seconds", type=float, default=8.0)
    args = parser.parse_args()
    share = asyncio.run(measure(args))
    print(json.dumps({"listen_s": args.listen_s, "core_share": round(share, 4)}))


if __name__ == "__main__":
    main()
