"""The tables of ``lorapool status``: workers and the request stream."""

from __future__ import annotations

import time

import orjson
from rich.table import Table

from lorapool.keys import WORKERS_GROUP


def worker_table(producer) -> Table:
    table = Table(title="workers")
    for column in ("name", "device", "adapters", "running", "waiting", "tokens/s", "seen"):
        table.add_column(column)
    now = time.time()
    for raw in producer.redis.hvals(producer.keys.workers):
        w = orjson.loads(raw)
        table.add_row(
            w["name"],
            w.get("device", "?"),
            ", ".join(w.get("adapters", [])) or "-",
            str(w.get("running", 0)),
            str(w.get("waiting", 0)),
            f"{w.get('tokens_per_s', 0):.1f}",
            f"{now - w.get('updated', now):.1f}s ago",
        )
    return table


def queue_table(producer) -> Table:
    r, keys = producer.redis, producer.keys
    table = Table(title="queue")
    for column in ("stream", "length", "pending", "lag", "dead letters"):
        table.add_column(column)
    group = next((g for g in _groups(r, keys.requests) if g["name"] == WORKERS_GROUP.encode()), {})
    table.add_row(
        keys.requests,
        str(r.xlen(keys.requests)),
        str(group.get("pending", 0)),
        str(group.get("lag", "-")),
        str(r.xlen(keys.dead)),
    )
    return table


def _groups(r, key) -> list[dict]:
    try:
        return r.xinfo_groups(key)
    except Exception:  # no stream yet
        return []


def status_tables(producer) -> list[Table]:
    return [worker_table(producer), queue_table(producer)]
