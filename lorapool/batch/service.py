"""Batches as their users see them: upload a file, create a batch over it, read its
state, cancel it, read its output. The CLI and the gateway both go through here."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, BinaryIO

import redis

from lorapool.batch import listing
from lorapool.batch.files import FileStore, FileTooLarge
from lorapool.batch.lines import ENDPOINTS
from lorapool.batch.state import WINDOWS, BatchState, Status
from lorapool.batch.tasks import BatchConfig, enqueue_step


class BatchError(ValueError):
    """A request about batches that cannot be served; ``param`` names the culprit."""

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.param, self.status = param, status


class BatchService:
    """The batches of one pool (``connection``: its Redis; ``config``: where files live)."""

    def __init__(self, connection: redis.Redis, config: BatchConfig):
        self.redis, self.config = connection, config
        self.files: FileStore = config.files(connection)
        self.state = BatchState(connection, config.keys)

    def upload(
        self, source: BinaryIO, filename: str, purpose: str = "batch", tenant: str | None = None
    ) -> dict[str, Any]:
        """Store an input file; its OpenAI file object. ``tenant`` (here and below): the
        caller's, over HTTP; a file or batch of another tenant is not found (None: no
        check, as for the CLI)."""
        if purpose != "batch":
            raise BatchError(f"purpose must be 'batch', got {purpose!r}", "purpose")
        try:
            return self.files.put(source, filename, purpose, tenant or "")
        except FileTooLarge as exc:
            raise BatchError(str(exc), "file", 413) from None

    def create(
        self,
        input_file_id: str,
        endpoint: str,
        completion_window: str = "24h",
        metadata: dict[str, str] | None = None,
        owner: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        """A new batch in ``validating``; its RQ validate job is enqueued. ``owner``: the
        caller's tenant and key id, put in every line's job."""
        if endpoint not in ENDPOINTS:
            raise BatchError(f"endpoint must be one of {sorted(ENDPOINTS)}", "endpoint")
        if completion_window not in WINDOWS:
            raise BatchError(
                f"completion_window must be one of {sorted(WINDOWS)}", "completion_window"
            )
        if metadata is not None and not (
            isinstance(metadata, dict)
            and all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())
        ):
            raise BatchError("metadata must map strings to strings", "metadata")
        self.file(input_file_id, (owner or {}).get("tenant"))
        batch = self.state.create(input_file_id, endpoint, completion_window, metadata, owner)
        enqueue_step(self.redis, self.config, "validate_batch", batch["id"])
        return batch

    def retrieve(self, batch_id: str, tenant: str | None = None) -> dict[str, Any]:
        batch = self.state.get(batch_id) if isinstance(batch_id, str) else None
        if batch is not None and tenant is not None:
            batch = batch if self.state.owner(batch_id).get("tenant") == tenant else None
        if batch is None:
            raise BatchError(f"no batch {batch_id!r}", "batch_id", 404)
        return batch

    def cancel(self, batch_id: str, tenant: str | None = None) -> dict[str, Any]:
        """Ask the batch to stop: lines not yet finished are aborted by its collector;
        finished ones stay in its output."""
        self.retrieve(batch_id, tenant)
        self.state.move(batch_id, Status.CANCELLING, Status.VALIDATING, Status.IN_PROGRESS)
        return self.retrieve(batch_id)

    def file(self, file_id: str, tenant: str | None = None) -> dict[str, Any]:
        try:
            if tenant is not None and self.files.owner(file_id) != tenant:
                raise KeyError(file_id)
            return self.files.info(file_id)
        except KeyError:
            raise BatchError(f"no file {file_id!r}", "file_id", 404) from None

    def content(self, file_id: str, tenant: str | None = None) -> Iterator[bytes]:
        """The file's bytes, a line at a time."""
        self.file(file_id, tenant)
        return (line + b"\n" for line in self.files.lines(file_id))

    def delete_file(self, file_id: str, tenant: str | None = None) -> dict[str, Any]:
        """Remove a file; OpenAI's ``{"id", "object": "file", "deleted": true}``."""
        self.file(file_id, tenant)
        try:
            self.files.delete(file_id)
        except KeyError:  # deleted meanwhile
            raise BatchError(f"no file {file_id!r}", "file_id", 404) from None
        return {"id": file_id, "object": "file", "deleted": True}

    def list_files(
        self,
        tenant: str | None = None,
        purpose: str | None = None,
        limit: Any = None,
        order: str = "desc",
        after: str | None = None,
    ) -> dict[str, Any]:
        """A page of the tenant's files (``listing``), newest first unless ``order``
        is ``asc``."""
        if order not in ("asc", "desc"):
            raise BatchError(f"order must be 'asc' or 'desc', got {order!r}", "order")
        size = self._limit(limit, listing.MAX_FILES, listing.MAX_FILES)
        files = listing.files_of(self.files, tenant, purpose)
        return listing.page(files[::-1] if order == "desc" else files, size, after)

    def list_batches(
        self, tenant: str | None = None, limit: Any = None, after: str | None = None
    ) -> dict[str, Any]:
        """A page of the tenant's batches, newest first."""
        size = self._limit(limit, listing.MAX_BATCHES, 20)
        return listing.page(listing.batches_of(self.redis, self.config.keys, tenant), size, after)

    @staticmethod
    def _limit(value: Any, most: int, default: int) -> int:
        try:
            return listing.check_limit(value, most, default)
        except ValueError as exc:
            raise BatchError(str(exc), "limit") from None
