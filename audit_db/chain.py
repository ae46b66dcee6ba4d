"""The hash chain: how rows are turned into canonical bytes and linked.

A completion row's hash links it to the row before. Version 1 (every row written
before revision 0003, and any row whose token ids do not fit int32)::

    row_hash = HMAC-SHA256(audit key, "lorapool audit chain v1", prev_hash, seq, body)
    row_hash = sha256(prev_hash "\\n" seq "\\n" body)            rows written without a key

where ``body`` is the sorted-key orjson of :data:`V1_COLUMNS` plus the
fingerprint of its adapter (the sha256 of the adapter's identity fields).
Version 2 (compact rows) hashes the token ids as packed int32 bytes
(``tokens.packed``) instead of JSON lists, under a domain of its own::

    row_hash = HMAC-SHA256(audit key, "lorapool audit chain v2", prev_hash, seq,
                           body without the token lists, prompt ids, output ids)

(without a key: sha256 over the same length-prefixed parts). The first row links
to :data:`GENESIS`. Without the key nobody can re-chain the table so that it
verifies; a row's version is part of what its hash says, so changing it breaks
the row. Rows from ``keyed_from`` on are keyed (see checkpoints.py). Everything
here is computed from plain (decoded) values, where a row's token ids are the
lists ``prompt_token_ids`` and ``token_ids`` whatever its version
(:func:`logical` turns a stored row into that form), so the writer and
``verify`` agree byte for byte.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import orjson

from lorapool import signing
from lorapool.audit_db.schema import ADAPTER_HASHES, ADAPTER_IDENTITY
from lorapool.audit_db.tokens import as_packed

GENESIS = "0" * 64
CHAIN_DOMAIN = "lorapool audit chain v1"
CHAIN_DOMAIN_V2 = "lorapool audit chain v2"
COMPACT_VERSION = 2
# What a version 1 row's hash covers: the columns of revision 0002 (frozen here:
# columns added later never enter an old row's hash).
V1_COLUMNS = (
    "pool",
    "request_id",
    "completion_index",
    "base_model_name",
    "base_model_sha256",
    "prompt",
    "prompt_token_ids",
    "num_prompt_tokens",
    "text",
    "token_ids",
    "num_output_tokens",
    "finish_reason",
    "stop_reason",
    "cumulative_logprob",
    "sampling_params",
    "request_metadata",
    "tenant",
    "worker",
    "arrival_time",
    "first_scheduled_time",
    "first_token_time",
    "last_token_time",
    "finished_time",
    "queue_time",
    "error",
    "written_at",
)
TOKEN_COLUMNS = ("prompt_token_ids", "token_ids")
V2_COLUMNS = tuple(c for c in V1_COLUMNS if c not in TOKEN_COLUMNS)


def canonical(value: Any) -> bytes:
    """Deterministic JSON bytes of plain values (sorted keys)."""
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)


def adapter_fingerprint(adapter: Mapping[str, Any]) -> str:
    """sha256 of an adapter row's identity fields: one adapter version. Its config
    sha256 and digest count where it has them (rows stored before 0008 have none)."""
    identity = {k: adapter[k] for k in ADAPTER_IDENTITY}
    identity["target_modules"] = list(identity["target_modules"])
    identity.update({k: adapter[k] for k in ADAPTER_HASHES if adapter.get(k) is not None})
    return hashlib.sha256(canonical(identity)).hexdigest()


def logical(row: Mapping[str, Any]) -> dict[str, Any]:
    """A stored row with its token ids as the lists ``prompt_token_ids`` and
    ``token_ids``, whichever columns its version keeps them in."""
    row = dict(row)
    if row.get("chain_version", 1) >= COMPACT_VERSION and "prompt_tokens" in row:
        row["prompt_token_ids"] = row["prompt_tokens"]
        row["token_ids"] = row["output_tokens"]
    return row


def _body(row: Mapping[str, Any], fingerprint: str | None, columns: tuple[str, ...]) -> dict:
    body = {k: row[k] for k in columns}
    if body["pool"] is None:  # rows written before the pool was recorded
        del body["pool"]
    body["adapter"] = fingerprint
    return body


def row_body(row: Mapping[str, Any], fingerprint: str | None, version: int = 1) -> bytes:
    """The canonical bytes of a (logical) row, without its chain position; version 2
    leaves the token lists out (they are hashed as packed bytes)."""
    return canonical(_body(row, fingerprint, V2_COLUMNS if version >= 2 else V1_COLUMNS))


def content_digest(row: Mapping[str, Any], fingerprint: str | None) -> str:
    """sha256 of what a (logical) row says, leaving out when it was written; the same
    whatever chain version stores it.

    Two records for one (pool, request, completion) with equal digests are the
    same record delivered twice; with different digests, a conflict.
    """
    body = _body(row, fingerprint, V1_COLUMNS)
    del body["written_at"]
    return hashlib.sha256(canonical(body)).hexdigest()


def link(prev_hash: str, seq: int, body: bytes, key: bytes | None = None) -> str:
    """The version 1 row hash that chains ``body`` at position ``seq`` after ``prev_hash``.

    With ``key``: HMAC-SHA256 under the audit key; without: plain sha256 (rows
    written before the chain had a key, or by an ``--insecure-no-key`` writer).
    """
    if key is not None:
        return signing.mac(key, CHAIN_DOMAIN, prev_hash.encode(), str(seq).encode(), body)
    digest = hashlib.sha256(f"{prev_hash}\n{seq}\n".encode())
    digest.update(body)
    return digest.hexdigest()


def link_v2(
    prev_hash: str, seq: int, body: bytes, tokens: tuple[bytes, bytes], key: bytes | None
) -> str:
    """The version 2 row hash: ``body`` (no token lists) and the packed token ids."""
    parts = (prev_hash.encode(), str(seq).encode(), body, *tokens)
    if key is not None:
        return signing.mac(key, CHAIN_DOMAIN_V2, *parts)
    digest = hashlib.sha256(CHAIN_DOMAIN_V2.encode() + b"\0")
    for part in parts:
        digest.update(len(part).to_bytes(8, "big"))
        digest.update(part)
    return digest.hexdigest()


def row_hash(
    row: Mapping[str, Any], prev_hash: str, fingerprint: str | None, key: bytes | None
) -> str:
    """The hash a row at ``row["seq"]`` must have after ``prev_hash``: a logical row, or
    a stored one as it is (a version 2 row's token ids in its compact columns, as lists
    or as the packed bytes themselves: a walk reads those, nothing to unpack and pack)."""
    version = row.get("chain_version", 1)
    body = row_body(row, fingerprint, version)
    if version >= COMPACT_VERSION:
        compact = "prompt_tokens" in row  # as logical() reads it
        prompt = row["prompt_tokens" if compact else "prompt_token_ids"]
        output = row["output_tokens" if compact else "token_ids"]
        return link_v2(prev_hash, row["seq"], body, (as_packed(prompt), as_packed(output)), key)
    return link(prev_hash, row["seq"], body, key)
