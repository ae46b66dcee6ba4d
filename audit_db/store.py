"""The append path: audit records in, chained rows out. There is no other write.

:func:`prepare` turns one record into its rows (hash bodies included) outside
any transaction; :func:`append` stores prepared rows in one transaction under
the audit write lock, so rows from concurrent writers get consecutive chain
positions. Rows already stored (same request id and completion index) are
skipped; the insert itself is also ``ON CONFLICT DO NOTHING`` (on PostgreSQL
after a COPY into a staging table, see pg_copy.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, Engine, func, select
from sqlalchemy.dialects import postgresql, sqlite

from lorapool.audit_db.chain import GENESIS, adapter_fingerprint, link, row_body
from lorapool.audit_db.database import write_transaction
from lorapool.audit_db.pg_copy import copy_insert
from lorapool.audit_db.record import AuditRecord, Output, RecordError
from lorapool.audit_db.schema import adapters, completions


class ChainError(RuntimeError):
    """The chain could not be extended consistently; the transaction was rolled back."""


@dataclass(frozen=True)
class PreparedRow:
    """One completion row, ready to be chained: values, hash body, adapter row."""

    values: dict[str, Any]
    body: bytes
    adapter: dict[str, Any] | None

    @property
    def key(self) -> tuple[str, int]:
        return self.values["request_id"], self.values["completion_index"]


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


def _request_values(record: AuditRecord, now: float) -> dict[str, Any]:
    m = record.metrics
    return {
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


def prepare(record: AuditRecord, now: float | None = None) -> list[PreparedRow]:
    """The rows of one record; raises RecordError when a value cannot be hashed."""
    now = time.time() if now is None else now
    adapter = adapter_row(record, now)
    fingerprint = adapter["fingerprint"] if adapter else None
    shared = _request_values(record, now)
    rows = []
    for output in _outputs(record):
        values = {**shared, **_output_values(output)}
        try:
            body = row_body(values, fingerprint)
        except TypeError as exc:  # e.g. an integer too large for JSON
            raise RecordError(f"cannot hash record: {exc}") from None
        rows.append(PreparedRow(values, body, adapter))
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


def _stored_keys(conn: Connection, rows: list[PreparedRow]) -> set[tuple[str, int]]:
    request_ids = sorted({r.key[0] for r in rows})
    query = select(completions.c.request_id, completions.c.completion_index).where(
        completions.c.request_id.in_(request_ids)
    )
    return {tuple(k) for k in conn.execute(query).all()}


def chain_head(conn: Connection) -> tuple[int, str]:
    """(seq, row_hash) of the last row in the chain; (0, GENESIS) when empty."""
    query = (
        select(completions.c.seq, completions.c.row_hash)
        .order_by(completions.c.seq.desc())
        .limit(1)
    )
    head = conn.execute(query).first()
    return (head[0], head[1]) if head else (0, GENESIS)


def _unique(rows: list[PreparedRow]) -> list[PreparedRow]:
    seen: dict[tuple[str, int], PreparedRow] = {}
    for row in rows:
        seen.setdefault(row.key, row)
    return list(seen.values())


def _chain(rows: list[PreparedRow], pks: dict[str, int], seq: int, prev: str) -> list[dict]:
    chained = []
    for row in rows:
        seq += 1
        row_hash = link(prev, seq, row.body)
        pk = pks[row.adapter["fingerprint"]] if row.adapter else None
        chained.append(
            {**row.values, "seq": seq, "adapter_pk": pk, "prev_hash": prev, "row_hash": row_hash}
        )
        prev = row_hash
    return chained


def _insert_chained(conn: Connection, rows: list[dict[str, Any]], head_seq: int) -> int:
    if conn.dialect.name == "postgresql":
        return copy_insert(conn, rows)
    _insert(conn, completions, rows, ["request_id", "completion_index"])
    return conn.execute(select(func.count()).where(completions.c.seq > head_seq)).scalar()


def append(engine: Engine, rows: list[PreparedRow]) -> int:
    """Store the rows not stored yet, chained, in one transaction; returns how many."""
    rows = _unique(rows)
    if not rows:
        return 0
    with write_transaction(engine) as conn:
        stored = _stored_keys(conn, rows)
        fresh = [r for r in rows if r.key not in stored]
        if not fresh:
            return 0
        pks = _adapter_pks(conn, fresh)
        head_seq, head_hash = chain_head(conn)
        added = _insert_chained(conn, _chain(fresh, pks, head_seq, head_hash), head_seq)
        if added != len(fresh):  # cannot happen under the lock; never leave a gap
            raise ChainError(f"expected {len(fresh)} new rows after seq {head_seq}, got {added}")
    return len(fresh)


def append_records(engine: Engine, records: list[AuditRecord]) -> int:
    """Prepare and store records (a convenience for tests and one-off imports)."""
    return append(engine, [row for record in records for row in prepare(record)])


__all__ = ["ChainError", "PreparedRow", "append", "append_records", "chain_head", "prepare"]
