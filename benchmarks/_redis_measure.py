"""What Redis spends and keeps, as the queue benchmarks measure it (a helper module:
``lorapool bench`` lists no name that starts with an underscore)."""

from __future__ import annotations


def redis_cpu_s(conn) -> float:
    """CPU seconds Redis has used: of every node, on a cluster."""
    import redis

    if isinstance(conn, redis.RedisCluster):
        nodes = conn.info("cpu", target_nodes=redis.RedisCluster.PRIMARIES).values()
    else:
        nodes = [conn.info("cpu")]
    return sum(info[k] for info in nodes for k in ("used_cpu_sys", "used_cpu_user"))


def command_calls(conn, command: str) -> int:
    """How many times Redis has run ``command`` (inside scripts too): ``INFO
    commandstats``, standalone."""
    return int(conn.info("commandstats").get(f"cmdstat_{command}", {}).get("calls", 0))


def chunk_log_bytes(conn, keys) -> tuple[int, int]:
    """(bytes, tokens) of the chunk logs: MEMORY USAGE summed, tokens counted."""
    from lorapool.records.chunk import decode_chunk

    total_bytes = total_tokens = 0
    for key in keys:
        total_bytes += conn.memory_usage(key, samples=0) or 0
        total_tokens += sum(decode_chunk(raw, key).num_tokens for raw in conn.lrange(key, 0, -1))
    return total_bytes, total_tokens


def finished_bytes(conn, keys, ids) -> tuple[int, int, int]:
    """Of finished requests: (MEMORY USAGE of their job hashes, their final records'
    bytes as a reader gets them (the compact chunk's JSON), those records' bytes as
    stored (compressed))."""
    from lorapool.lifecycle.chunk_log import decode_result
    from lorapool.records.chunk import encode_chunk
    from lorapool.records.marker import RESULT_FIELD

    memory = sum(conn.memory_usage(keys.job(rid), samples=0) or 0 for rid in ids)
    stored = [conn.hget(keys.job(rid), RESULT_FIELD) or b"" for rid in ids]
    records = sum(len(encode_chunk(decode_result(r, rid))) for r, rid in zip(stored, ids) if r)
    return memory, records, sum(map(len, stored))
