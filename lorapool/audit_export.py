"""Audit rows as CSV, JSON or JSON Lines, encoded a few rows at a time.

The one encoder of every audit export (``lorapool audit search/export`` and the
gateway's ``/v1/audit`` routes): :func:`encode` turns an iterable of rows (plain
dicts or dataclasses) into chunks of UTF-8 bytes, so a caller that streams rows
from a server-side cursor streams bytes out with bounded memory.

CSV is for spreadsheets. A cell whose text starts with ``=``, ``+``, ``-``,
``@``, tab or carriage return would be read as a formula by Excel, LibreOffice
or Google Sheets (CSV injection, OWASP's list). A spreadsheet may also split a
cell where we did not: a locale whose separator is ``;`` reads ``X;=1+1;x`` as
three cells, the middle one a formula, quoted or not (a quote inside a field is
no quote to it). So every text cell is quoted, and a ``'`` goes before each of
those characters that starts the text or follows (after any spaces) a
separator any locale uses (``,`` ``;`` tab ``|``), a line break or a quote
(:func:`neutralise`): spreadsheets show a cell starting with ``'`` as text and do
not evaluate it. Numbers are written as numbers, unquoted (``-1.5`` stays
``-1.5``); nested values (token ids, metadata) as JSON, neutralised too. JSON
and JSON Lines exports are exact, NUL and every code point included (U+0085, U+2028
and U+2029 as escapes, ``lorapool.jsonl``: one row a line for ``str.splitlines`` too).

May import: the standard library and orjson.
"""

from __future__ import annotations

import csv
import io
import re
from collections.abc import Iterable, Iterator
from dataclasses import asdict, is_dataclass
from typing import Any

import orjson

from lorapool.jsonl import dumps_line

FORMATS = ("csv", "json", "jsonl")
MEDIA_TYPES = {
    "csv": "text/csv; charset=utf-8",
    "json": "application/json",
    "jsonl": "application/x-ndjson",
}
FORMULA_START = ("=", "+", "-", "@", "\t", "\r")
CELL_BREAKS = ',;\t|\r\n"'  # where some spreadsheet may begin a cell: separators, lines, quotes
_FORMULA_AT = re.compile(
    "(^|[{}])( *)(?=[{}])".format(re.escape(CELL_BREAKS), re.escape("".join(FORMULA_START)))
)
CHUNK_BYTES = 64 * 1024  # encoded output is handed on in pieces of about this size


def neutralise(text: str) -> str:
    """``text`` with a ``'`` before each formula character that a spreadsheet could
    read at the start of a cell, whatever separator it splits on."""
    return _FORMULA_AT.sub(r"\1\2'", text)


def plain(item: Any) -> dict[str, Any]:
    """A row as a plain dict (dataclasses such as ``UsageRow`` included)."""
    return asdict(item) if is_dataclass(item) else dict(item)


def csv_cell(value: Any) -> Any:
    """One CSV cell: JSON for nested values, '' for None, text neutralised."""
    if value is None:
        return ""
    if isinstance(value, (list, dict, tuple)):
        return neutralise(orjson.dumps(value).decode())
    if isinstance(value, str):
        return neutralise(value)
    return value


def _csv_chunks(rows: Iterator[dict[str, Any]]) -> Iterator[bytes]:
    first = next(rows, None)
    if first is None:
        return
    buffer = io.StringIO()
    # RFC 4180 (CRLF, quotes doubled); every text cell quoted, numbers bare
    writer = csv.DictWriter(buffer, fieldnames=list(first), quoting=csv.QUOTE_NONNUMERIC)
    writer.writeheader()
    for row in _chain(first, rows):
        writer.writerow({k: csv_cell(v) for k, v in row.items()})
        if buffer.tell() >= CHUNK_BYTES:
            yield buffer.getvalue().encode()
            buffer.seek(0)
            buffer.truncate()
    yield buffer.getvalue().encode()


def _chain(first: dict[str, Any], rest: Iterator[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    yield first
    yield from rest


def _lines(rows: Iterator[dict[str, Any]], head: bytes, sep: bytes, tail: bytes, empty: bytes):
    parts, size, opened = [head], len(head), False
    for row in rows:
        line = dumps_line(row)  # U+2028 and kin escaped: one line for every reader
        parts.append(sep + line if opened else line)
        size += len(line) + len(sep)
        opened = True
        if size >= CHUNK_BYTES:
            yield b"".join(parts)
            parts, size = [], 0
    parts.append(tail if opened else empty)
    yield b"".join(parts)


def encode(items: Iterable[Any], fmt: str) -> Iterator[bytes]:
    """The rows of ``items`` in ``fmt`` (one of :data:`FORMATS`), in chunks of bytes.

    CSV: a header line from the first row's keys, then a line per row (nothing at
    all for no rows). JSON: one array. JSON Lines: one object per line.
    """
    rows = map(plain, items)
    if fmt == "csv":
        return _csv_chunks(iter(rows))
    if fmt == "json":
        return _lines(rows, b"[", b",\n", b"]\n", b"]\n")
    if fmt == "jsonl":
        return _lines(rows, b"", b"\n", b"\n", b"")
    raise ValueError(f"format must be one of {', '.join(FORMATS)}, not {fmt!r}")


def encode_all(items: Iterable[Any], fmt: str) -> bytes:
    """:func:`encode`, joined (for small results)."""
    return b"".join(encode(items, fmt))
