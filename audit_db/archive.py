"""Retention that keeps the chain: a month's rows out to a file, verifiable offline.

:func:`archive_month` (``lorapool audit archive --before MONTH``; the owner's, with
the audit key) takes the oldest month still in the table, walks its rows from the
position the previous archive ended at, verifying each one, and writes them with
the adapters they name and the checkpoints among them to ``<folder>/audit-<month>-
<first>-<last>.jsonl.gz``, then a signed :class:`~.archive_manifest.Manifest` next
to it. It reads the file back and verifies it as :func:`verify_file` would, and
only then, under the chain lock, records the manifest in ``archives`` and detaches
and drops the month's partition (PostgreSQL). The newest month never goes (the
chain's head stays in the table); months go oldest first, so what is online is
always one stretch of the chain, which ``audit verify`` walks from the last
manifest's end.

A line of the file is a JSON object with ``"kind"``: ``archive`` (the first: what
it holds), ``adapter``, ``checkpoint`` and ``row`` (every column of the row, token
ids as lists), in that order, rows in chain order. SQLite keeps every row (single
node, development): archiving is PostgreSQL's.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import orjson
from sqlalchemy import Connection, Engine, func, select, text

from lorapool.audit_db import checkpoints, partitions, rollup
from lorapool.audit_db.archive_manifest import ArchiveError, Manifest, manifests
from lorapool.audit_db.chain import GENESIS, adapter_fingerprint, logical
from lorapool.audit_db.checkpoints import Checkpoint
from lorapool.audit_db.database import write_transaction
from lorapool.audit_db.guard import keyed_from
from lorapool.audit_db.schema import adapters, archives, completions
from lorapool.audit_db.walk import BadRow, Walk, rows_after

FILE_VERSION = 1
MANIFEST_SUFFIX = ".manifest.json"


@dataclass(frozen=True)
class Stretch:
    """The rows of one month: positions ``first..last``, after (start_seq, start_hash)."""

    period: int
    first: int
    last: int
    count: int
    start_hash: str
    keyed_from: int | None


def _json(value) -> bytes:
    return orjson.dumps(value) + b"\n"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _stretch(conn: Connection, period: int) -> Stretch:
    """The oldest month's rows, checked: it is the oldest, and not the head's."""
    if not partitions.partitioned(conn):
        raise ArchiveError("archiving is PostgreSQL's: SQLite (development) keeps every row")
    where = completions.c.period == period
    first, last, count = conn.execute(
        select(func.min(completions.c.seq), func.max(completions.c.seq), func.count()).where(where)
    ).one()
    if first is None:
        raise ArchiveError(f"month {period} has no rows")
    oldest = conn.execute(select(func.min(completions.c.seq))).scalar()
    head = conn.execute(select(func.max(completions.c.seq))).scalar()
    if first != oldest or count != last - first + 1:
        raise ArchiveError(f"month {period} is not the oldest stretch of the chain")
    if last == head:
        raise ArchiveError(f"month {period} holds the chain's newest row: it stays online")
    made = manifests(conn)
    start_hash = made[-1].end_hash if made else GENESIS
    if (made[-1].last_seq if made else 0) != first - 1:
        raise ArchiveError(f"no archive accounts for the rows before {first}")
    points = checkpoints.every(conn)
    keyed = points[-1].keyed_from if points else keyed_from(conn)
    return Stretch(period, first, last, count, start_hash, keyed)


def _lines(conn: Connection, stretch: Stretch, walk: Walk, counts: dict) -> Iterator[bytes]:
    """The archive file's lines, every row verified on the way (``counts``: of each kind)."""
    yield _json({"kind": "archive", "v": FILE_VERSION, **asdict(stretch)})
    for row in conn.execute(select(adapters).order_by(adapters.c.pk)).mappings():
        counts["adapter"] = counts.get("adapter", 0) + 1
        yield _json({"kind": "adapter", **{str(k): v for k, v in row.items()}})
    points = [p for p in checkpoints.every(conn) if stretch.first <= p.seq <= stretch.last]
    counts["checkpoint"] = len(points)
    for point in points:
        yield _json({"kind": "checkpoint", **asdict(point)})
    for row in rows_after(conn, stretch.first - 1, stretch.last):
        if not walk.take(row):
            raise ArchiveError(f"the month does not verify: {walk.first_bad.describe()}")
        yield _json({"kind": "row", **_row_fields(logical({str(k): v for k, v in row.items()}))})


def _row_fields(row: dict) -> dict:
    """A logical row without the compact columns (its token ids are the lists)."""
    row.pop("prompt_tokens", None)
    row.pop("output_tokens", None)
    return row


def _write(path: Path, lines: Iterator[bytes]) -> tuple[int, str]:
    """Write ``lines`` gzipped to ``path`` (made new); returns (bytes, sha256)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o444)
    try:
        with os.fdopen(fd, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as out:
            for line in lines:
                out.write(line)
        with path.open("rb") as f:
            os.fsync(f.fileno())
        digest = _sha256(path)
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    return path.stat().st_size, digest


def _walk_for(conn: Connection, stretch: Stretch, key: bytes) -> Walk:
    prints = {r["pk"]: adapter_fingerprint(r) for r in conn.execute(select(adapters)).mappings()}
    marks = {p.seq: p.row_hash for p in checkpoints.every(conn)}
    return Walk(stretch.first - 1, stretch.start_hash, key, stretch.keyed_from, prints, marks)


def _manifest(stretch: Stretch, walk: Walk, path: Path, counts: dict, key: bytes) -> Manifest:
    draft = Manifest(
        period=stretch.period,
        first_seq=stretch.first,
        last_seq=stretch.last,
        num_rows=walk.num_rows,
        start_hash=stretch.start_hash,
        end_hash=walk.row_hash,
        keyed_from=stretch.keyed_from,
        num_checkpoints=counts.get("checkpoint", 0),
        num_adapters=counts.get("adapter", 0),
        file_name=path.name,
        file_bytes=counts["bytes"],
        file_sha256=counts["sha256"],
        created_at=time.time(),
    )
    return draft.signed(key)


def _drop(engine: Engine, stretch: Stretch, manifest: Manifest) -> None:
    """Record the manifest, then detach and drop the month, if nothing changed."""
    with write_transaction(engine) as conn:
        now = _stretch(conn, stretch.period)
        end = conn.execute(select(completions.c.row_hash).where(completions.c.seq == now.last))
        if now != stretch or end.scalar() != manifest.end_hash:
            raise ArchiveError(f"month {stretch.period} changed while it was archived")
        head = conn.execute(select(func.max(completions.c.seq))).scalar()
        rollup.refresh(conn, head)  # the month's usage stays answerable once it is gone
        count = conn.execute(select(func.count()).select_from(archives)).scalar()
        conn.execute(
            archives.insert(),
            {
                "id": count + 1,
                "period": stretch.period,
                "first_seq": stretch.first,
                "last_seq": stretch.last,
                "manifest": manifest.to_json().decode(),
                "archived_at": time.time(),
            },
        )
        part = f"{partitions.PARTITION_PREFIX}{stretch.period}"
        conn.execute(text(f"ALTER TABLE completions DETACH PARTITION {part}"))
        conn.execute(text(f"DROP TABLE {part}"))


def archive_month(engine: Engine, key: bytes, period: int, folder: str | Path) -> Manifest:
    """Archive month ``period`` (the oldest in the table) into ``folder``; see the
    module docstring. Returns its manifest."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    with engine.connect() as conn:
        stretch = _stretch(conn, period)
        walk = _walk_for(conn, stretch, key)
        path = folder / f"audit-{period}-{stretch.first}-{stretch.last}.jsonl.gz"
        counts: dict = {}
        counts["bytes"], counts["sha256"] = _write(path, _lines(conn, stretch, walk, counts))
    manifest = _manifest(stretch, walk, path, counts, key)
    manifest_path = path.with_name(path.name + MANIFEST_SUFFIX)
    manifest_path.write_bytes(manifest.to_json())
    report = verify_file(path, key)
    if not report.ok:
        raise ArchiveError(f"{path} does not verify as written: {report.problem}")
    _drop(engine, stretch, manifest)
    return manifest


def archive_before(
    engine: Engine, key: bytes, before: int, folder: str | Path, say: Callable = print
) -> list[Manifest]:
    """Archive every month before ``before`` (yyyymm), oldest first; empty months'
    partitions are dropped. Returns the manifests made."""
    made = []
    with engine.connect() as conn:
        if not partitions.partitioned(conn):
            raise ArchiveError("archiving is PostgreSQL's: SQLite (development) keeps every row")
        periods = [p for p in partitions.existing(conn) if p < before]
    for period in periods:
        if _empty(engine, period):
            continue
        manifest = archive_month(engine, key, period, folder)
        rows = f"rows {manifest.first_seq}-{manifest.last_seq}"
        say(f"archived {period}: {rows} -> {manifest.file_name}")
        made.append(manifest)
    return made


def _empty(engine: Engine, period: int) -> bool:
    with engine.connect() as conn:
        query = select(completions.c.seq).where(completions.c.period == period).limit(1)
        return conn.execute(query).first() is None


@dataclass(frozen=True)
class FileReport:
    """What :func:`verify_file` found; ``ok`` when ``problem`` is None."""

    manifest: Manifest | None
    num_rows: int
    problem: str | None
    first_bad: BadRow | None = None

    @property
    def ok(self) -> bool:
        return self.problem is None


def _file_lines(path: Path) -> Iterator[dict]:
    with gzip.open(path, "rb") as f:
        for line in f:
            yield orjson.loads(line)


def _check_file(
    path: Path, manifest: Manifest, key: bytes
) -> tuple[int, str | None, BadRow | None]:
    if _sha256(path) != manifest.file_sha256 or path.stat().st_size != manifest.file_bytes:
        return 0, "the file is not the one its manifest describes (size or sha256 differ)", None
    walk = Walk(manifest.first_seq - 1, manifest.start_hash, key, manifest.keyed_from)
    for item in _file_lines(path):
        kind = item.pop("kind")
        if kind == "adapter":
            walk.fingerprints[item["pk"]] = adapter_fingerprint(item)
        elif kind == "checkpoint":
            point = Checkpoint(**item)
            if not checkpoints.signed_by(point, key):
                return walk.num_rows, f"checkpoint {point.id} in the file is not signed", None
            walk.marks[point.seq] = point.row_hash
        elif kind == "row" and not walk.take(item):
            return walk.num_rows, "a row does not verify", walk.first_bad
    reached = (walk.seq, walk.row_hash, walk.num_rows)
    if reached != (manifest.last_seq, manifest.end_hash, manifest.num_rows):
        return walk.num_rows, "the rows do not end where the manifest says", None
    return walk.num_rows, None, None


def verify_file(
    path: str | Path, key: bytes, manifest_path: str | Path | None = None
) -> FileReport:
    """Verify an archive file offline (no database): its manifest's signature, the
    file's sha256, every row's hash from the manifest's start to its end, the
    checkpoints in it."""
    path = Path(path)
    manifest_path = Path(manifest_path or path.with_name(path.name + MANIFEST_SUFFIX))
    try:
        manifest = Manifest.from_json(manifest_path.read_bytes())
    except (OSError, ArchiveError) as exc:
        return FileReport(None, 0, f"cannot read the manifest {manifest_path}: {exc}")
    if not manifest.signed_by(key):
        return FileReport(manifest, 0, "the manifest is not signed with the audit key")
    try:
        rows, problem, bad = _check_file(path, manifest, key)
    except (OSError, EOFError, orjson.JSONDecodeError, KeyError, TypeError) as exc:
        return FileReport(manifest, 0, f"cannot read {path}: {exc}")  # BadGzipFile: OSError
    return FileReport(manifest, rows, problem, bad)
