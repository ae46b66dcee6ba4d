"""The tables of ``lorapool status``: workers and the request stream."""

from __future__ import annotations

import time

from rich.table import Table

from lorapool.lifecycle.keys import WORKERS_GROUP
from lorapool.records.heartbeat import Heartbeat, decode_heartbeats


def worker_table(producer) -> Table:
    """One row a live worker: ``adapters`` those of the requests it runs, ``loaded``
    those in its engine's device slots (LRU: they stay loaded while idle)."""
    table = Table(title="workers")
    for column in ("name", "device", "adapters", "loaded", "running", "waiting", "tokens/s",
                   "seen"):  # fmt: skip
        table.add_column(column)
    now = time.time()
    for w in live_workers(producer.redis, producer.keys):
        table.add_row(
            w.name,
            w.device or "?",
            ", ".join(w.adapters) or "-",
            ", ".join(w.loaded) or "-",
            str(w.running or 0),
            str(w.waiting or 0),
            f"{w.tokens_per_s or 0:.1f}",
            seen(now, w.updated),
        )
    return table


def seen(now: float, updated: float | None) -> str:
    """How long ago a heartbeat was written; a clock a little ahead (another host's)
    reads as just now, never as a negative age."""
    if updated is None:
        return "?"
    return f"{max(0.0, now - updated):.1f}s ago"


def live_workers(r, keys) -> list[Heartbeat]:
    """Heartbeat records of the workers whose ``{p}:alive:{name}`` has not expired.

    Records of workers that stopped without saying so (killed) are removed.
    """
    records = decode_heartbeats(r.hgetall(keys.workers))
    names = list(records)
    alive = r.mget([keys.alive(n) for n in names]) if names else []
    dead = [n for n, flag in zip(names, alive) if flag is None]
    if dead:
        r.hdel(keys.workers, *dead)
    return [records[n] for n, flag in zip(names, alive) if flag is not None]


def queue_table(producer) -> Table:
    r, keys = producer.redis, producer.keys
    table = Table(title="queue")
    for column in ("stream", "length", "pending", "lag", "dead letters"):
        table.add_column(column)
    for view in keys.shard_views:  # per shard: the interactive stream, then the batch one
        dead = str(r.xlen(view.dead))
        for stream in view.streams:
            group = next((g for g in _groups(r, stream) if g["name"] == WORKERS_GROUP.encode()), {})
            table.add_row(
                stream,
                str(r.xlen(stream)),
                str(group.get("pending", 0)),
                str(group.get("lag", "-")),
                dead if stream == view.requests else "",
            )
    return table


def _groups(r, key) -> list[dict]:
    try:
        return r.xinfo_groups(key)
    except Exception:  # no stream yet
        return []


def shard_table(producer) -> Table | None:
    """On a Redis Cluster: each shard's hash tag, slot and the node that serves it, and its
    load (jobs queued or pending on its streams), so that a master left without a shard,
    or with too many, shows. None for a standalone Redis."""
    r, keys = producer.redis, producer.keys
    if not keys.shards:
        return None
    from redis.crc import key_slot

    table = Table(title=f"shards ({keys.shards})")
    for column in ("shard", "tag", "slot", "node", "queued", "pending"):
        table.add_column(column)
    for s, view in enumerate(keys.shard_views):
        node = r.get_node_from_key(view.requests) if hasattr(r, "get_node_from_key") else None
        queued = pending = 0
        for stream in view.streams:
            group = next((g for g in _groups(r, stream) if g["name"] == WORKERS_GROUP.encode()), {})
            pending += int(group.get("pending", 0))
            queued += int(group["lag"]) if group.get("lag") is not None else int(r.xlen(stream))
        tag = view.requests.split("}")[0].lstrip("{")
        where = f"{node.host}:{node.port}" if node is not None else "-"
        table.add_row(str(s), tag, str(key_slot(tag.encode())), where, str(queued), str(pending))
    return table


def status_tables(producer) -> list[Table]:
    shards = shard_table(producer)
    return [worker_table(producer), queue_table(producer), *([shards] if shards else [])]
