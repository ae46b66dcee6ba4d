"""Audit records into rows: what :func:`prepare` makes of one record, outside any
transaction, for the append path (store.py) to chain.

One row per completion (a request that failed before producing anything still
gets one); a row is written as a compact chain version 2 row when its token ids
fit int32, else as a version 1 row (chain.py).
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from lorapool.audit_db import tokens
from lorapool.audit_db.chain import COMPACT_VERSION, adapter_fingerprint, content_digest, row_body
from lorapool.audit_db.schema import ADAPTER_HASHES
from lorapool.lifecycle.keys import DEFAULT_PREFIX
from lorapool.records.audit import AdapterInfo, AuditRecord, Output, RecordError


@dataclass(frozen=True)
class PreparedRow:
    """One completion row, ready to be chained: values, hash body, adapter row.

    ``values`` are logical (token ids as lists, see chain.logical); ``version`` is
    the chain version it is written under and ``tokens`` its packed token ids
    (version 2). ``digest`` identifies what the row says (see
    ``chain.content_digest``; computed when first asked for); ``source`` names
    where it came from (the stream entry id), for conflicts.
    """

    values: dict[str, Any]
    body: bytes
    adapter: dict[str, Any] | None
    version: int = 1
    tokens: tuple[bytes, bytes] | None = None
    source: str | None = None

    @property
    def key(self) -> tuple[str, str, int]:
        return self.values["pool"], self.values["request_id"], self.values["completion_index"]

    @cached_property
    def digest(self) -> str:
        fingerprint = self.adapter["fingerprint"] if self.adapter else None
        return content_digest(self.values, fingerprint)


def adapter_row(record: AuditRecord, now: float) -> dict[str, Any] | None:
    """The ``adapters`` row of the record's adapter (None for the base model), first
    seen ``now``."""
    info = record.adapter
    if info is None:
        return None
    return {**_identity(info, repr(info.alpha)), "first_seen": now}


@functools.lru_cache(maxsize=4096)  # a pool serves a few adapter versions: each is
def _identity(info: AdapterInfo, alpha: str) -> dict[str, Any]:  # hashed once, not per row
    """The identity fields of an adapter row and their fingerprint (do not mutate).
    ``alpha`` as text is part of the cache key: 0.0 == -0.0, but they hash apart."""
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
    # an adapter's hashes (revision 0008) only when its record has them: the row of one
    # registered before them is the row it always was, into any revision's table
    row.update({k: getattr(info, k) for k in ADAPTER_HASHES if getattr(info, k) is not None})
    row["fingerprint"] = adapter_fingerprint(row)
    return row


def _outputs(record: AuditRecord) -> tuple[Output, ...]:
    """A request that failed before producing anything still gets one row."""
    if record.outputs:
        return record.outputs
    reason = "error" if record.error else "abort"
    return (Output(0, "", (), finish_reason=reason),)


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
    prompt = tokens.packed_or_none(shared["prompt_token_ids"])
    rows = []
    for output in _outputs(record):
        values = {**shared, **_output_values(output)}
        ids = tokens.packed_or_none(values["token_ids"]) if prompt is not None else None
        packed = None if ids is None else (prompt, ids)
        version = 1 if packed is None else COMPACT_VERSION
        try:
            body = row_body(values, fingerprint, version)
        except TypeError as exc:  # e.g. an integer too large for JSON
            raise RecordError(f"cannot hash record: {exc}") from None
        rows.append(PreparedRow(values, body, adapter, version, packed, source))
    return rows
