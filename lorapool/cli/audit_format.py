"""Rendering audit rows and usage as a table, JSON or CSV for `lorapool audit` (rich);
CSV and JSON through ``lorapool.audit_export``, the exports' one encoder."""

from __future__ import annotations

import io
from collections.abc import Sequence
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

import orjson

from lorapool.audit_export import encode_all, plain

if TYPE_CHECKING:  # rich only for tables: JSON and CSV start ~0.1 s sooner without it
    from rich.table import Table


def _table(title: str | None) -> Table:
    from rich.table import Table

    return Table(title=title)


FORMATS = ("table", "json", "csv")
_ROW_SUMMARY = (
    ("request", "request_id"),
    ("#", "completion_index"),
    ("adapter", "adapter"),
    ("weights", "adapter_sha256"),
    ("tenant", "tenant"),
    ("finish", "finish_reason"),
    ("tokens", "num_output_tokens"),
    ("arrival (UTC)", "arrival_time"),
    ("text", "text"),
)


def iso_time(value: float | None) -> str:
    if value is None:
        return ""
    return datetime.fromtimestamp(value, timezone.utc).isoformat(timespec="milliseconds")


def to_json(items: Sequence[Any]) -> str:
    return orjson.dumps([plain(i) for i in items], option=orjson.OPT_INDENT_2).decode()


def to_csv(items: Sequence[Any]) -> str:
    """Rows as CSV (header from the first row), cells neutralised against formulas."""
    return encode_all(items, "csv").decode()


_TEXT_WIDTH = 60  # a summary cell shows at most this many characters


def _summary_cell(row: dict[str, Any], key: str) -> str:
    if key == "adapter":
        name = row.get("adapter_name")
        return "(base model)" if name is None else f"{name} #{row['adapter_id']}"
    if key == "adapter_sha256":
        return (row.get(key) or "")[:12]
    if key == "arrival_time":
        return iso_time(row.get(key))[:23]
    value = row.get(key)
    text = "" if value is None else str(value)
    return text if len(text) <= _TEXT_WIDTH else text[: _TEXT_WIDTH - 1] + "…"


def rows_table(rows: Sequence[dict[str, Any]], title: str | None = None) -> Table:
    """One line per completion, the columns a reviewer looks at first."""
    table = _table(title)
    for header, _key in _ROW_SUMMARY:
        table.add_column(header, overflow="fold")
    for row in rows:
        table.add_row(*(_summary_cell(row, key) for _h, key in _ROW_SUMMARY))
    return table


def record_table(row: dict[str, Any]) -> Table:
    """Every field of one audit row, one per line."""
    table = _table(f"{row['request_id']} / completion {row['completion_index']}")
    table.add_column("field", style="bold")
    table.add_column("value", overflow="fold")
    for key, value in row.items():
        shown = iso_time(value) if key.endswith("_time") and key != "queue_time" else value
        table.add_row(key, "" if shown is None else str(shown))
    return table


def conflicts_table(rows: Sequence[dict[str, Any]]) -> Table:
    """One line per conflict: the key, where the refused record came from, both digests."""
    table = _table(f"{len(rows)} conflicts")
    for header in ("pool", "request", "#", "entry", "detected (UTC)", "stored", "refused"):
        table.add_column(header, overflow="fold")
    for row in rows:
        table.add_row(
            row["pool"],
            row["request_id"],
            str(row["completion_index"]),
            row["source"] or "",
            iso_time(row["detected_at"])[:23],
            row["stored_digest"][:12],
            row["refused_digest"][:12],
        )
    return table


def usage_table(rows: Sequence[Any], title: str | None = None) -> Table:
    table = _table(title)
    headers = ("key", "requests", "prompt tok", "output tok", "errors", "p50 s", "p95 s")
    for i, header in enumerate(headers):
        table.add_column(header, justify="left" if i == 0 else "right")
    for row in rows:
        p50, p95 = ("" if v is None else f"{v:.3f}" for v in (row.latency_p50, row.latency_p95))
        table.add_row(
            row.key,
            str(row.requests),
            str(row.prompt_tokens),
            str(row.completion_tokens),
            str(row.errors),
            p50,
            p95,
        )
    return table


def render(table: Table) -> str:
    """A rich table as plain text (no colours), wide enough not to squeeze it."""
    from rich.console import Console

    console = Console(file=io.StringIO(), width=200, color_system=None, record=True)
    console.print(table)
    return console.export_text()
