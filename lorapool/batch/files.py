"""Batch files in Redis: inputs uploaded by users, outputs and errors written by the
collector, seen alike by every gateway replica, RQ worker and CLI of the pool.

A file is two keys (``lorapool/lifecycle/keys.py``): ``file`` (its OpenAI file object
and owner, JSON) and ``file_data`` (its bytes, a list of blocks of up to
``BLOCK_BYTES``), both expiring after ``retention_s``, and an entry in the ``files``
index (id -> expiry). A file is written to a ``file_part`` list and renamed into place
when complete, so a reader never sees half a file; a writer that dies leaves a part
that expires after ``PART_TTL_S``.

Files are streamed both ways: an upload is read and pushed a block at a time, and
``lines`` reads ``PAGE_BLOCKS`` blocks a round trip and splits one at a time, so
neither a 200 MB upload nor a 100,000-line output is ever in memory. What they cost:
their size in Redis memory for ``retention_s`` (docs/batch.md).
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

import orjson
import redis

from lorapool.connection import client_for
from lorapool.jsonl import dumps_line
from lorapool.lifecycle.keys import Keys

DEFAULT_RETENTION_S = 30 * 24 * 3600
MAX_FILE_BYTES = 200 * 1024 * 1024  # OpenAI's limit for a batch input file
BLOCK_BYTES = 1 << 16  # one list element
PAGE_BLOCKS = 4  # blocks an LRANGE reads: 256 KiB a round trip
PART_TTL_S = 24 * 3600  # a file being written expires unless finished by then
_ID = re.compile(r"file-[0-9a-f]{32}")


class FileTooLarge(ValueError):
    """An upload over the store's ``max_bytes``."""


@dataclass
class FileStore:
    """The batch files of one pool, in its Redis (``connection``, ``keys``)."""

    redis: redis.Redis
    keys: Keys
    retention_s: int = DEFAULT_RETENTION_S
    max_bytes: int = MAX_FILE_BYTES

    def info(self, file_id: str) -> dict[str, Any]:
        """The OpenAI file object of ``file_id`` (KeyError if unknown or expired)."""
        info = self._meta(file_id)
        info.pop("owner", None)
        return info

    def owner(self, file_id: str) -> str:
        """The tenant the file belongs to ('' for none; KeyError if unknown)."""
        return self._meta(file_id).get("owner", "")

    def exists(self, file_id: str) -> bool:
        return _ID.fullmatch(file_id or "") is not None and bool(
            self.redis.exists(self.keys.file(file_id))
        )

    def _meta(self, file_id: str) -> dict[str, Any]:
        raw = self.redis.get(self.keys.file(file_id)) if _ID.fullmatch(file_id or "") else None
        if raw is None:
            raise KeyError(file_id)
        return orjson.loads(raw)

    def put(
        self, source: BinaryIO, filename: str, purpose: str = "batch", owner: str = ""
    ) -> dict[str, Any]:
        """Store what ``source`` reads, a block at a time; FileTooLarge past ``max_bytes``
        (and nothing stored)."""
        file_id = new_id()
        part, size = self.keys.file_part(file_id), 0
        try:
            while block := source.read(BLOCK_BYTES):
                size += len(block)
                if size > self.max_bytes:
                    raise FileTooLarge(f"the file is over {self.max_bytes} bytes")
                self._append(part, [block])
        except BaseException:
            self.redis.delete(part)
            raise
        return self._finish(file_id, filename, purpose, size, owner)

    def writer(self, filename: str, purpose: str = "batch_output", owner: str = "") -> LineWriter:
        """A new file written one JSON object a line; it appears when ``finish`` is called."""
        return LineWriter(self, new_id(), filename, purpose, owner)

    def lines(self, file_id: str) -> Iterator[bytes]:
        """The file's lines, one at a time (without the newline); KeyError if unknown."""
        self._meta(file_id)
        data, start, carry = self.keys.file_data(file_id), 0, b""
        while blocks := self.redis.lrange(data, start, start + PAGE_BLOCKS - 1):
            start += len(blocks)
            for block in blocks:
                *complete, carry = (carry + block).split(b"\n")
                for line in complete:
                    yield line.rstrip(b"\r")
        if carry:
            yield carry.rstrip(b"\r")

    def delete(self, file_id: str) -> None:
        """Remove the file (KeyError if unknown)."""
        self._meta(file_id)
        with client_for(self.redis, self.keys.files).pipeline() as pipe:
            pipe.delete(self.keys.file(file_id), self.keys.file_data(file_id))
            pipe.zrem(self.keys.files, file_id)
            pipe.execute()

    def ids(self, now: float | None = None) -> list[str]:
        """The ids of the files not yet expired, oldest first (expired ones leave the
        index)."""
        now = time.time() if now is None else now
        self.redis.zremrangebyscore(self.keys.files, "-inf", now)
        return [i.decode() for i in self.redis.zrangebyscore(self.keys.files, now, "+inf")]

    def _append(self, part: str, blocks: list[bytes]) -> None:
        with self.redis.pipeline(transaction=False) as pipe:
            pipe.rpush(part, *blocks)
            pipe.expire(part, PART_TTL_S)
            pipe.execute()

    def _finish(self, file_id: str, filename: str, purpose: str, size: int, owner: str) -> dict:
        """Make the file visible: its blocks renamed into place, its object and index
        entry written, each expiring after ``retention_s``; its OpenAI file object."""
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
        data = self.keys.file_data(file_id)
        with client_for(self.redis, data).pipeline() as pipe:  # MULTI: all or none
            if size:
                pipe.rename(self.keys.file_part(file_id), data)
                pipe.expire(data, self.retention_s)
            pipe.set(self.keys.file(file_id), orjson.dumps(meta), ex=self.retention_s)
            pipe.zadd(self.keys.files, {file_id: info["expires_at"]})
            pipe.execute()
        return info


class LineWriter:
    """A file being written by a collector (a ``file_part`` list until finished)."""

    def __init__(self, store: FileStore, file_id: str, filename: str, purpose: str, owner: str):
        self.store, self.id, self.filename, self.purpose = store, file_id, filename, purpose
        self.owner = owner
        self.part = store.keys.file_part(file_id)
        self.buffer: list[bytes] = []
        self.buffered = 0
        self.size, self.count = 0, 0

    def write(self, record: dict[str, Any]) -> None:
        line = dumps_line(record) + b"\n"  # one line for str.splitlines too (jsonl.py)
        self.buffer.append(line)
        self.buffered += len(line)
        self.size, self.count = self.size + len(line), self.count + 1
        if self.buffered >= BLOCK_BYTES:
            self._flush()

    def _flush(self) -> None:
        if self.buffer:
            self.store._append(self.part, [b"".join(self.buffer)])
            self.buffer, self.buffered = [], 0

    def finish(self) -> dict[str, Any]:
        self._flush()
        return self.store._finish(self.id, self.filename, self.purpose, self.size, self.owner)

    def discard(self) -> None:
        self.buffer, self.buffered = [], 0
        self.store.redis.delete(self.part)


def new_id() -> str:
    return f"file-{uuid.uuid4().hex}"
