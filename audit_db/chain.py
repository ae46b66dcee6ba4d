"""The hash chain: how rows are turned into canonical bytes and linked.

A completion row's hash is ``sha256(prev_hash "\\n" seq "\\n" body)`` where
``body`` is the sorted-key orjson of its hashed columns plus the fingerprint
of its adapter (which is itself the sha256 of the adapter's identity fields).
The first row links to :data:`GENESIS`. Everything here is computed from
plain values, so the writer and ``verify`` agree byte for byte.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import orjson

from lorapool.audit_db.schema import ADAPTER_IDENTITY, HASHED_COLUMNS

GENESIS = "0" * 64
_BODY_COLUMNS = tuple(c for c in HASHED_COLUMNS if c != "seq")


def canonical(value: Any) -> bytes:
    """Deterministic JSON bytes of plain values (sorted keys)."""
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)


def adapter_fingerprint(adapter: Mapping[str, Any]) -> str:
    """sha256 of an adapter row's identity fields: one adapter version."""
    identity = {k: adapter[k] for k in ADAPTER_IDENTITY}
    identity["target_modules"] = list(identity["target_modules"])
    return hashlib.sha256(canonical(identity)).hexdigest()


def row_body(row: Mapping[str, Any], fingerprint: str | None) -> bytes:
    """The canonical bytes of a completion row, without its chain position."""
    body = {k: row[k] for k in _BODY_COLUMNS}
    body["adapter"] = fingerprint
    return canonical(body)


def link(prev_hash: str, seq: int, body: bytes) -> str:
    """The row hash that chains ``body`` at position ``seq`` after ``prev_hash``."""
    digest = hashlib.sha256(f"{prev_hash}\n{seq}\n".encode())
    digest.update(body)
    return digest.hexdigest()
