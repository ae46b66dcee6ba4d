"""Reading a pool's per-shard streams on either layout (tests/integration/conftest.py):
one standalone Redis (one shard view) or a sharded Redis Cluster (one view per shard)."""

from lorapool.lifecycle.keys import WORKERS_GROUP, Keys


def entries(conn, keys: Keys, stream: str) -> list:
    """Every entry of the per-shard stream named ``stream`` (``"audit"``, ``"dead"``,
    ``"requests"``...), over every shard, shard by shard."""
    return [entry for view in keys.shard_views for entry in conn.xrange(getattr(view, stream))]


def length(conn, keys: Keys, stream: str) -> int:
    """XLEN of the per-shard stream ``stream``, summed over every shard."""
    return sum(conn.xlen(getattr(view, stream)) for view in keys.shard_views)


def pending(conn, keys: Keys, stream: str = "requests", group: str = WORKERS_GROUP) -> int:
    """Entries of ``stream`` delivered to ``group`` and not acked, over every shard."""
    return sum(conn.xpending(getattr(view, stream), group)["pending"] for view in keys.shard_views)


def ids_on_shard(keys: Keys, shard: int, count: int, tag: str) -> list[str]:
    """``count`` request ids of shard ``shard`` (any ids on one standalone Redis)."""
    ids = (f"{tag}-{i}" for i in range(10_000))
    return [rid for rid, _ in zip((r for r in ids if keys.shard_of(r) == shard), range(count))]


async def async_result(url: str, keys: Keys, rid: str, timeout: float = 30):
    """``rid``'s final output as a fresh ``AsyncProducer`` of the pool reads it (its own
    follower: the channel, the log, the final record)."""
    from lorapool.producer import AsyncProducer

    producer = AsyncProducer(url, prefix=keys.prefix, shards=keys.shards)
    try:
        return await (await producer.handle(rid)).result(timeout=timeout)
    finally:
        await producer.aclose()
