"""The append path: audit records in, chained rows out. There is no other write.

:func:`prepare` turns one record into its rows (hash bodies included) outside
any transaction; :func:`append` stores prepared rows in one transaction under
the audit write lock, so rows from concurrent writers get consecutive chain
positions. A row whose key (pool, request id, completion index) is already
stored is skipped when it says the same thing (a redelivery) and recorded in
``conflicts`` when it does not: never silently dropped. The insert itself is
also ``ON CONFLICT DO NOTHING`` (on PostgreSQL after a COPY into a staging
table, see pg_copy.py). With the audit key the chain is keyed from the first
keyed write on (``audit_meta.keyed_from_seq``); a writer without the key
cannot extend a keyed chain.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Connection, Engine, func, select
from sqlalchemy.dialects import postgresql, sqlite

from lorapool.audit_db.chain import (
    GENESIS,
    adapter_fingerprint,
    content_digest,
    link,
    row_body,
)
from lorapool.audit_db.database import write_transaction
from lorapool.audit_db.pg_copy import copy_insert
from lorapool.audit_db.schema import adapters, audit_meta, completions, conflicts
from lorapool.audit_record import AuditRecord, Output, RecordError
from lorapool.lifecycle.keys import DEFAULT_PREFIX

KEYED_FROM = "keyed_from_seq"


class ChainError(RuntimeError):
    """The chain could not be extended consistently; the transaction was rolled back."""


class KeyedChainError(RuntimeError):
    """A writer without the audit key was asked to extend a keyed chain."""


@dataclass(frozen=True)
class PreparedRow:
    """One completion row, ready to be chained: values, hash body, adapter row.

    ``digest`` identifies what the row says (see ``chain.content_digest``);
    ``source`` names where it came from (the stream entry id), for conflicts.
    """

    values: dict[str, Any]
    body: bytes
    adapter: dict[str, Any] | None
    digest: str
    source: str | None = None

    @property
    def key(self) -> tuple[str, str, int]:
        return self.values["pool"], self.values["request_id"], self.values["completion_index"]


@dataclass(frozen=True)
class Conflict:
    """A row refused because a different row is stored (or kept) under its key."""

    row: PreparedRow
    stored_digest: str


@dataclass
class AppendResult:
    """What :func:`append` did: rows written, redeliveries skipped, conflicts recorded."""

    written: int = 0
    duplicates: int = 0
    conflicts: list[Conflict] = field(default_factory=list)


def adapter_row(record: AuditRecord, now: float) -> dict[str, Any] | None:
    info = record.adapter
    if info is None:
        return None
    row = {
        "name": info.name,
        "adapter_id": info.id,
        "path": info.path,
        "sha256": info.sha256,
        "rank": info.rank,
        "alpha": float(info.alpha),
        "target_modules": list(info.target_modules),
        "base_model": info.base_model,
    }
    row["fingerprint"] = adapter_fingerprint(row)
    row["first_seen"] = now
    return row


def _outputs(record: AuditRecord) -> tuple[Output, ...]:
    """A request that failed before producing anything still gets one row."""
    if record.outputs:
        return record.outputs
    reason = "error" if record.error else "abort"
    return (Output(0, "", (), None, reason, None),)


def _tenant(metadata: dict[str, Any]) -> str | None:
    tenant = metadata.get("tenant")
    return tenant if isinstance(tenant, str) else None


def _request_values(record: AuditRecord, pool: str, now: float) -> dict[str, Any]:
    m = record.metrics
    return {
        "pool": pool,
        "request_id": record.request_id,
        "base_model_name": record.base_model.name,
        "base_model_sha256": record.base_model.sha256,
        "prompt": record.prompt,
        "prompt_token_ids": list(record.prompt_token_ids),
        "num_prompt_tokens": m.num_prompt_tokens,
        "sampling_params": record.sampling_params,
        "request_metadata": record.metadata,
        "tenant": _tenant(record.metadata),
        "worker": record.worker,
        "arrival_time": m.arrival_time,
        "first_scheduled_time": m.first_scheduled_time,
        "first_token_time": m.first_token_time,
        "last_token_time": m.last_token_time,
        "finished_time": m.finished_time,
        "queue_time": m.queue_time,
        "error": record.error,
        "written_at": now,
    }


def _output_values(output: Output) -> dict[str, Any]:
    return {
        "completion_index": output.index,
        "text": output.text,
        "token_ids": list(output.token_ids),
        "num_output_tokens": len(output.token_ids),
        "finish_reason": output.finish_reason,
        "stop_reason": output.stop_reason,
        "cumulative_logprob": output.cumulative_logprob,
    }


def prepare(
    record: AuditRecord,
    pool: str = DEFAULT_PREFIX,
    now: float | None = None,
    source: str | None = None,
) -> list[PreparedRow]:
    """The rows of one record for ``pool``; raises RecordError when a value cannot be hashed."""
    now = time.time() if now is None else now
    adapter = adapter_row(record, now)
    fingerprint = adapter["fingerprint"] if adapter else None
    shared = _request_values(record, pool, now)
    rows = []
    for output in _outputs(record):
        values = {**shared, **_output_values(output)}
        try:
            body = row_body(values, fingerprint)
        except TypeError as exc:  # e.g. an integer too large for JSON
            raise RecordError(f"cannot hash record: {exc}") from None
        rows.append(PreparedRow(values, body, adapter, content_digest(values, fingerprint), source))
    return rows


def _insert(conn: Connection, table, rows: list[dict[str, Any]], key: list[str]) -> None:
    """INSERT ... ON CONFLICT DO NOTHING, as one executemany (psycopg pipelines it)."""
    dialect = postgresql if conn.dialect.name == "postgresql" else sqlite
    conn.execute(dialect.insert(table).on_conflict_do_nothing(index_elements=key), rows)


def _adapter_pks(conn: Connection, rows: list[PreparedRow]) -> dict[str, int]:
    wanted = {r.adapter["fingerprint"]: r.adapter for r in rows if r.adapter}
    if not wanted:
        return {}
    _insert(conn, adapters, list(wanted.values()), ["fingerprint"])
    found = conn.execute(
        select(adapters.c.fingerprint, adapters.c.pk).where(
            adapters.c.fingerprint.in_(list(wanted))
        )
    )
    return dict(found.all())


def _stored_digests(conn: Connection, rows: list[PreparedRow]) -> dict[tuple, str]:
    """The content digest of every stored row that has the key of one of ``rows``."""
    wanted = {r.key for r in rows}
    query = (
        select(completions, adapters.c.fingerprint)
        .select_from(completions.outerjoin(adapters, completions.c.adapter_pk == adapters.c.pk))
        .where(  # request_id leads the unique index: an index lookup
            completions.c.request_id.in_(sorted({k[1] for k in wanted})),
            completions.c.pool.in_(sorted({k[0] for k in wanted})),
        )
    )
    stored = {}
    for row in conn.execute(query).mappings():
        key = (row["pool"], row["request_id"], row["completion_index"])
        if key in wanted:
            stored[key] = content_digest(row, row["fingerprint"])
    return stored


def chain_head(conn: Connection) -> tuple[int, str]:
    """(seq, row_hash) of the last row in the chain; (0, GENESIS) when empty."""
    query = (
        select(completions.c.seq, completions.c.row_hash)
        .order_by(completions.c.seq.desc())
        .limit(1)
    )
    head = conn.execute(query).first()
    return (head[0], head[1]) if head else (0, GENESIS)


def _sort_out(
    rows: list[PreparedRow], stored: dict[tuple, str]
) -> tuple[list[PreparedRow], AppendResult]:
    """The rows to store, and the result so far (duplicates and conflicts counted)."""
    kept: dict[tuple, str] = dict(stored)
    fresh, result = [], AppendResult()
    for row in rows:
        digest = kept.get(row.key)
        if digest is None:
            kept[row.key] = row.digest
            fresh.append(row)
        elif digest == row.digest:
            result.duplicates += 1
        else:
            result.conflicts.append(Conflict(row, digest))
    return fresh, result


def _record_conflicts(conn: Connection, found: list[Conflict], now: float) -> None:
    if not found:
        return
    conn.execute(
        conflicts.insert(),
        [
            {
                "pool": c.row.key[0],
                "request_id": c.row.key[1],
                "completion_index": c.row.key[2],
                "stored_digest": c.stored_digest,
                "refused_digest": c.row.digest,
                "refused_row": {**c.row.values, "adapter": c.row.adapter},
                "source": c.row.source,
                "detected_at": now,
            }
            for c in found
        ],
    )


def keyed_from(conn: Connection) -> int | None:
    """The first chain position written with the audit key (None: no keyed row yet)."""
    value = conn.execute(select(audit_meta.c.value).where(audit_meta.c.name == KEYED_FROM)).scalar()
    return None if value is None else int(value)


def _check_key(conn: Connection, key: bytes | None, head_seq: int) -> None:
    start = keyed_from(conn)
    if key is None and start is not None:
        raise KeyedChainError(
            f"the audit chain is keyed from row {start}; this writer has no audit key "
            "(give it LORAPOOL_AUDIT_KEY or LORAPOOL_AUDIT_KEY_FILE)"
        )
    if key is not None and start is None:
        conn.execute(audit_meta.insert(), {"name": KEYED_FROM, "value": str(head_seq + 1)})


def _chain(
    rows: list[PreparedRow], pks: dict[str, int], seq: int, prev: str, key: bytes | None
) -> list[dict]:
    chained = []
    for row in rows:
        seq += 1
        row_hash = link(prev, seq, row.body, key)
        pk = pks[row.adapter["fingerprint"]] if row.adapter else None
        chained.append(
            {**row.values, "seq": seq, "adapter_pk": pk, "prev_hash": prev, "row_hash": row_hash}
        )
        prev = row_hash
    return chained


def _insert_chained(conn: Connection, rows: list[dict[str, Any]], head_seq: int) -> int:
    if conn.dialect.name == "postgresql":
        return copy_insert(conn, rows)
    _insert(conn, completions, rows, ["pool", "request_id", "completion_index"])
    return conn.execute(select(func.count()).where(completions.c.seq > head_seq)).scalar()


def append(engine: Engine, rows: list[PreparedRow], key: bytes | None = None) -> AppendResult:
    """Store the rows not stored yet, chained (keyed with ``key``), in one transaction.

    Rows that repeat a stored row are counted as duplicates; rows that
    contradict one are recorded in ``conflicts`` (and returned), not stored.
    """
    if not rows:
        return AppendResult()
    with write_transaction(engine) as conn:
        fresh, result = _sort_out(rows, _stored_digests(conn, rows))
        _record_conflicts(conn, result.conflicts, time.time())
        if not fresh:
            return result
        pks = _adapter_pks(conn, fresh)
        head_seq, head_hash = chain_head(conn)
        _check_key(conn, key, head_seq)
        added = _insert_chained(conn, _chain(fresh, pks, head_seq, head_hash, key), head_seq)
        if added != len(fresh):  # cannot happen under the lock; never leave a gap
            raise ChainError(f"expected {len(fresh)} new rows after seq {head_seq}, got {added}")
    result.written = len(fresh)
    return result


def append_records(
    engine: Engine,
    records: list[AuditRecord],
    pool: str = DEFAULT_PREFIX,
    key: bytes | None = None,
) -> int:
    """Prepare and store records (a convenience for tests and one-off imports)."""
    rows = [row for record in records for row in prepare(record, pool)]
    return append(engine, rows, key).written


__all__ = [
    "AppendResult",
    "Conflict",
    "ChainError",
    "KeyedChainError",
    "PreparedRow",
    "append",
    "append_records",
    "chain_head",
    "keyed_from",
    "prepare",
]
