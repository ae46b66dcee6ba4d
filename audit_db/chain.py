"""The hash chain: how rows are turned into canonical bytes and linked.

A completion row's hash links it to the row before::

    row_hash = HMAC-SHA256(audit key, prev_hash, seq, body)   keyed rows
    row_hash = sha256(prev_hash "\\n" seq "\\n" body)          rows written without a key

where ``body`` is the sorted-key orjson of its hashed columns plus the
fingerprint of its adapter (the sha256 of the adapter's identity fields). The
first row links to :data:`GENESIS`. Without the key nobody can re-chain the
table so that it verifies. Rows from ``audit_meta.keyed_from_seq`` on are
keyed; rows before it were written before the chain had a key. Everything here
is computed from plain (decoded) values, so the writer and ``verify`` agree
byte for byte.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import orjson

from lorapool import signing
from lorapool.audit_db.schema import ADAPTER_IDENTITY, HASHED_COLUMNS

GENESIS = "0" * 64
CHAIN_DOMAIN = "lorapool audit chain v1"
_BODY_COLUMNS = tuple(c for c in HASHED_COLUMNS if c != "seq")


def canonical(value: Any) -> bytes:
    """Deterministic JSON bytes of plain values (sorted keys)."""
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)


def adapter_fingerprint(adapter: Mapping[str, Any]) -> str:
    """sha256 of an adapter row's identity fields: one adapter version."""
    identity = {k: adapter[k] for k in ADAPTER_IDENTITY}
    identity["target_modules"] = list(identity["target_modules"])
    return hashlib.sha256(canonical(identity)).hexdigest()


def _body(row: Mapping[str, Any], fingerprint: str | None) -> dict[str, Any]:
    body = {k: row[k] for k in _BODY_COLUMNS}
    if body["pool"] is None:  # rows written before the pool was recorded
        del body["pool"]
    body["adapter"] = fingerprint
    return body


def row_body(row: Mapping[str, Any], fingerprint: str | None) -> bytes:
    """The canonical bytes of a completion row, without its chain position."""
    return canonical(_body(row, fingerprint))


def content_digest(row: Mapping[str, Any], fingerprint: str | None) -> str:
    """sha256 of what a row says, leaving out when it was written.

    Two records for one (pool, request, completion) with equal digests are the
    same record delivered twice; with different digests, a conflict.
    """
    body = _body(row, fingerprint)
    del body["written_at"]
    return hashlib.sha256(canonical(body)).hexdigest()


def link(prev_hash: str, seq: int, body: bytes, key: bytes | None = None) -> str:
    """The row hash that chains ``body`` at position ``seq`` after ``prev_hash``.

    With ``key``: HMAC-SHA256 under the audit key; without: plain sha256 (rows
    written before the chain had a key, or by an ``--insecure-no-key`` writer).
    """
    if key is not None:
        return signing.mac(key, CHAIN_DOMAIN, prev_hash.encode(), str(seq).encode(), body)
    digest = hashlib.sha256(f"{prev_hash}\n{seq}\n".encode())
    digest.update(body)
    return digest.hexdigest()
