"""The audit record of a finished request, signed with the worker's audit key."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lorapool.records.audit import AuditRecord, encode_audit_record, record_from_output
from lorapool.records.chunk import Chunk
from lorapool.worker.held import Held

if TYPE_CHECKING:
    from lorapool.worker.state import WorkerState


def final_audit(state: WorkerState, held: Held, chunk: Chunk) -> bytes:
    """The audit record of a final chunk (every finished request, failed ones too), else b"".

    ``held`` has taken ``chunk`` already: the record holds the whole output. (On the
    sender's thread for the chunks of a trip: ``state``'s name, model and config only.)"""
    if not chunk.finished:
        return b""
    config = state.config  # no key: --insecure-no-key, the writer cannot check it
    return encode_audit_record(audit_record(state, held), config.audit_key, config.prefix)


def audit_record(state: WorkerState, held: Held) -> AuditRecord:
    """Built straight from the request's accumulated chunk (``Held.whole``): the record
    a finished log is compacted into, no ``RequestOutput`` made for it."""
    whole = held.whole()
    return record_from_output(
        whole,
        worker=state.name,
        base_model=state.base_model,
        adapter=held.adapter,
        sampling_params=held.job.sampling_params.to_dict(),
        metadata=held.job.metadata,
        error=whole.error,
    )
