"""Lists of files and batches with OpenAI's cursor pagination: ``limit``, ``after`` (the
last id of the previous page) and ``order``; a page is ``{"object": "list", "data",
"first_id", "last_id", "has_more"}``, which the ``openai`` client's ``files.list()``
and ``batches.list()`` page through.

A tenant sees its own only. Each list reads the pool's index (files: ``files``, by
expiry; batches: ``batches``, by creation) and every record in one round trip, so a
call costs one read per file or batch the pool keeps (files expire after their
retention; batches stay until deleted).
"""

from __future__ import annotations

from typing import Any

import orjson
import redis

from lorapool.batch.files import FileStore
from lorapool.batch.state import _decode, openai_shape
from lorapool.lifecycle.keys import Keys

MAX_FILES = 10_000  # OpenAI's bounds on limit
MAX_BATCHES = 100


def page(items: list[dict[str, Any]], limit: int, after: str | None) -> dict[str, Any]:
    """One page of ``items`` (already in order): those after the id ``after``."""
    if after is not None:
        ids = [item["id"] for item in items]
        items = items[ids.index(after) + 1 :] if after in ids else []
    data = items[:limit]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": len(items) > limit,
    }


def files_of(store: FileStore, tenant: str | None, purpose: str | None) -> list[dict]:
    """The OpenAI file objects of ``tenant`` (None: every file), oldest first."""
    ids = store.ids()
    raws = store.redis.mget([store.keys.file(i) for i in ids]) if ids else []
    out = []
    for raw in raws:
        if raw is None:  # expired between the index and the read
            continue
        meta = orjson.loads(raw)
        owner = meta.pop("owner", "")
        if (tenant is None or owner == tenant) and purpose in (None, meta.get("purpose")):
            out.append(meta)
    return sorted(out, key=lambda f: (f["created_at"], f["id"]))


def batches_of(connection: redis.Redis, keys: Keys, tenant: str | None) -> list[dict]:
    """The batches of ``tenant`` (None: every batch), newest first."""
    ids = [i.decode() for i in connection.zrangebyscore(keys.batches, "-inf", "+inf")][::-1]
    with connection.pipeline(transaction=False) as pipe:
        for batch_id in ids:
            pipe.hgetall(keys.batch(batch_id))
        raws = pipe.execute() if ids else []
    out = []
    for raw in raws:
        if not raw:
            continue
        record = _decode(raw)
        owner = orjson.loads(record.get("owner") or "{}")
        if tenant is None or owner.get("tenant") == tenant:
            out.append(openai_shape(record))
    return out


def check_limit(value: Any, most: int, default: int) -> int:
    """``limit`` as OpenAI bounds it; ValueError naming it otherwise."""
    if value is None:
        return default
    try:
        limit = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"limit must be an integer in [1, {most}], got {value!r}") from None
    if not 1 <= limit <= most:
        raise ValueError(f"limit must be an integer in [1, {most}], got {value!r}")
    return limit
