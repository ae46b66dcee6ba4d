"""The audit record of a finished request, signed with the worker's audit key."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import orjson

from lorapool.audit_record import record_from_output, sign_record
from lorapool.lifecycle.wire import Chunk
from lorapool.worker.held import Held

if TYPE_CHECKING:
    from lorapool.worker.worker import Worker

ADAPTER_FIELDS = ("name", "id", "path", "sha256", "rank", "alpha", "target_modules", "base_model")


def final_audit(worker: Worker, held: Held, chunk: Chunk) -> bytes:
    """The audit record of a final chunk (every finished request, failed ones too), else b"".

    ``held`` has taken ``chunk`` already: the record holds the whole output."""
    if not chunk.finished:
        return b""
    return orjson.dumps(audit_record(worker, held))


def audit_record(worker: Worker, held: Held) -> dict[str, Any]:
    adapter = None
    if held.adapter is not None:
        adapter = {k: held.adapter.get(k) for k in ADAPTER_FIELDS}
    output = held.output()
    record = record_from_output(
        output,
        worker=worker.name,
        base_model=worker.base_model,
        adapter=adapter,
        sampling_params=held.job.sampling_params.to_dict(),
        metadata=held.job.metadata,
        error=output.error,
    )
    if worker.config.audit_key is None:  # --insecure-no-key: the writer cannot check it
        return record
    return sign_record(record, worker.config.audit_key, worker.config.prefix)
