"""Batch files on disk: inputs uploaded by users, outputs and errors written by the
collector. One directory; each file is ``<id>.jsonl`` beside ``<id>.json`` (its
OpenAI file object), kept for ``retention_s`` and then swept.

Files are read and written line by line: a 100,000-line batch is never in memory.
"""

from __future__ import annotations

import os
import re
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import orjson

DEFAULT_RETENTION_S = 30 * 24 * 3600
MAX_FILE_BYTES = 200 * 1024 * 1024  # OpenAI's limit for a batch input file
_ID = re.compile(r"file-[0-9a-f]{32}")
_COPY = 1 << 16
PARTIAL_MAX_AGE_S = 24 * 3600


class FileTooLarge(ValueError):
    """An upload over the store's ``max_bytes``."""


@dataclass
class FileStore:
    """The batch files of one pool, in ``root``."""

    root: Path
    retention_s: int = DEFAULT_RETENTION_S
    max_bytes: int = MAX_FILE_BYTES

    def __post_init__(self):
        self.root = Path(self.root)
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, file_id: str) -> Path:
        """The content of ``file_id``; KeyError for an id that is malformed or gone."""
        if not _ID.fullmatch(file_id or "") or not (self.root / f"{file_id}.json").exists():
            raise KeyError(file_id)
        return self.root / f"{file_id}.jsonl"

    def info(self, file_id: str) -> dict[str, Any]:
        """The OpenAI file object of ``file_id`` (KeyError if unknown)."""
        info = self._meta(file_id)
        info.pop("owner", None)
        return info

    def owner(self, file_id: str) -> str:
        """The tenant the file belongs to ('' for none; KeyError if unknown)."""
        return self._meta(file_id).get("owner", "")

    def _meta(self, file_id: str) -> dict[str, Any]:
        self.path(file_id)
        return orjson.loads((self.root / f"{file_id}.json").read_bytes())

    def put(
        self, source: BinaryIO, filename: str, purpose: str = "batch", owner: str = ""
    ) -> dict[str, Any]:
        """Store what ``source`` reads (copied in blocks); FileTooLarge past ``max_bytes``."""
        self.sweep()
        file_id = new_id()
        target, size = self.root / f"{file_id}.jsonl", 0
        with open(target, "wb") as out:
            while block := source.read(_COPY):
                size += len(block)
                if size > self.max_bytes:
                    out.close()
                    target.unlink()
                    raise FileTooLarge(f"the file is over {self.max_bytes} bytes")
                out.write(block)
        return self._describe(file_id, filename, purpose, size, owner)

    def writer(self, filename: str, purpose: str = "batch_output", owner: str = "") -> LineWriter:
        """A new file written one JSON object a line; it appears when ``finish`` is called."""
        return LineWriter(self, new_id(), filename, purpose, owner)

    def lines(self, file_id: str) -> Iterator[bytes]:
        """The file's lines, one at a time (without the newline)."""
        with open(self.path(file_id), "rb") as f:
            for line in f:
                yield line.rstrip(b"\r\n")

    def delete(self, file_id: str) -> None:
        path = self.path(file_id)
        (self.root / f"{file_id}.json").unlink(missing_ok=True)
        path.unlink(missing_ok=True)

    def sweep(self, now: float | None = None) -> int:
        """Delete the files past their retention; how many went."""
        now, gone = time.time() if now is None else now, 0
        for meta in self.root.glob("file-*.json"):
            try:
                expires = orjson.loads(meta.read_bytes()).get("expires_at")
            except (OSError, orjson.JSONDecodeError):
                continue
            if expires is not None and expires <= now:
                self.delete(meta.stem)
                gone += 1
        for partial in self.root.glob("file-*.partial"):  # left by a collector that died
            if partial.stat().st_mtime < now - PARTIAL_MAX_AGE_S:
                partial.unlink(missing_ok=True)
        return gone

    def _describe(self, file_id: str, filename: str, purpose: str, size: int, owner: str) -> dict:
        created = int(time.time())
        info = {
            "id": file_id,
            "object": "file",
            "bytes": size,
            "created_at": created,
            "expires_at": created + self.retention_s,
            "filename": filename,
            "purpose": purpose,
            "status": "processed",
        }
        meta = {**info, "owner": owner} if owner else info
        (self.root / f"{file_id}.json").write_bytes(orjson.dumps(meta))
        return info


class LineWriter:
    """A file being written by a collector (a ``.partial`` until finished)."""

    def __init__(self, store: FileStore, file_id: str, filename: str, purpose: str, owner: str):
        self.store, self.id, self.filename, self.purpose = store, file_id, filename, purpose
        self.owner = owner
        self.partial = store.root / f"{file_id}.partial"
        self.file = open(self.partial, "wb")  # noqa: SIM115 (closed by finish/discard)
        self.size, self.count = 0, 0

    def write(self, record: dict[str, Any]) -> None:
        line = orjson.dumps(record) + b"\n"
        self.file.write(line)
        self.size, self.count = self.size + len(line), self.count + 1

    def finish(self) -> dict[str, Any]:
        self.file.close()
        os.replace(self.partial, self.store.root / f"{self.id}.jsonl")
        return self.store._describe(self.id, self.filename, self.purpose, self.size, self.owner)

    def discard(self) -> None:
        self.file.close()
        self.partial.unlink(missing_ok=True)


def new_id() -> str:
    return f"file-{uuid.uuid4().hex}"
