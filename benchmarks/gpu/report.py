"""The kit's results: what a section records as it goes, and the JSON and Markdown reports.

A section runs in a process of its own and records every figure and check the
moment it has it (``Recorder`` rewrites its result file each time), so a
section stopped at its time box still reports what it got. The parent merges
the sections' results into ``report.json`` and ``report.md`` after each one.

A section's status: ``ok`` (every check held), ``fail`` (a check did not hold:
a wrong result), ``error`` (it raised), ``timeout`` (stopped at its time box),
``skipped`` (not run: no time left, or not asked for).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

STATUSES = ("ok", "fail", "error", "timeout", "skipped")


class Recorder:
    """A section's figures, checks and tables, flushed to ``path`` on every change."""

    def __init__(self, name: str, path: Path | None):
        self.path = path
        self.start = time.monotonic()
        self.data = {"name": name, "status": "running", "figures": {}, "checks": [], "tables": {}}
        self.data["notes"] = []
        self.flush()

    def figure(self, key: str, value) -> None:
        self.data["figures"][key] = value
        self.flush()

    def check(self, name: str, ok: bool, detail: str = "") -> bool:
        """Record a check; a check that does not hold makes the section ``fail``."""
        self.data["checks"].append({"name": name, "ok": bool(ok), "detail": detail})
        self.flush()
        return bool(ok)

    def row(self, table: str, row: dict) -> None:
        self.data["tables"].setdefault(table, []).append(row)
        self.flush()

    def note(self, text: str) -> None:
        self.data["notes"].append(text)
        self.flush()

    def cut_short(self, what: str) -> None:
        """The time box ended the section before ``what``: it ends as ``timeout``."""
        self.data["cut_short"] = True
        self.note(f"time box reached: {what} not run")

    def finish(self, status: str | None = None, error: str | None = None) -> dict:
        failed = any(not c["ok"] for c in self.data["checks"])
        cut = self.data.get("cut_short")
        self.data["status"] = status or ("fail" if failed else "timeout" if cut else "ok")
        if error:
            self.data["error"] = error
        self.flush()
        return self.data

    def flush(self) -> None:
        self.data["seconds"] = round(time.monotonic() - self.start, 2)
        if self.path is None:
            return
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        os.replace(tmp, self.path)


def read_result(path: Path, name: str) -> dict:
    """A section's result file as the section left it (an empty result if it wrote none)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {"name": name, "status": "error", "figures": {}, "checks": [], "tables": {}}


def overall(sections: list[dict]) -> str:
    """``fail`` if any check failed, ``incomplete`` if a section did not finish, else ``ok``."""
    if any(s["status"] == "fail" for s in sections):
        return "fail"
    if any(s["status"] != "ok" for s in sections):
        return "incomplete"
    return "ok"


def write_reports(out: Path, meta: dict, sections: list[dict]) -> None:
    """``report.json``, its copy named by ``report_name`` (the file to commit under
    ``benchmarks/gpu/reports/``) and ``report.md`` in ``out``, after every section."""
    out.mkdir(parents=True, exist_ok=True)
    report = {**meta, "status": overall(sections), "sections": sections}
    report["acceptance"] = acceptance(sections)
    text = json.dumps(report, indent=1, default=str)
    (out / "report.json").write_text(text)
    (out / report_name(meta)).write_text(text)
    (out / "report.md").write_text(markdown(report))


def report_name(meta: dict) -> str:
    """``<date>-<commit>[-part<N>].json``: runs compare field by field, file by file."""
    part = f"-part{meta['part']}" if meta.get("part") else ""
    commit = "".join(c for c in str(meta.get("commit", "unknown")) if c.isalnum()) or "unknown"
    return f"{meta.get('date', 'undated')}-{commit}{part}.json"


def acceptance(sections: list[dict]) -> dict:
    """The figures issues 47 and 51 accept by (``acceptance_*`` of every section, and
    the LoRA kernels' best share of the copy bandwidth at decode shapes), by section."""
    found = {}
    for s in sections:
        figures = s.get("figures", {})
        picked = {k: v for k, v in figures.items() if k.startswith("acceptance_")}
        if s["name"] == "kernels" and "lora_decode_bw_fraction" in figures:
            picked["lora_decode_bw_fraction"] = figures["lora_decode_bw_fraction"]
        if picked:
            found[s["name"]] = picked
    return found


def markdown(report: dict) -> str:
    lines = [
        f"# lorapool GPU proof kit: {report['status']}",
        "",
        f"- command: `{report.get('command', '')}`",
        f"- commit: {report.get('commit', '?')}; mode: {report.get('mode', '?')}; "
        f"wall: {report.get('wall_s', '?')} s of a {report.get('budget_s', '?')} s budget",
        "",
    ]
    if report.get("acceptance"):
        lines += [
            "Acceptance figures (issue 47; `tenants`: issue 51):",
            "",
            "| section | figure | value |",
            "|---|---|---|",
        ]
        for name, figures in report["acceptance"].items():
            lines += [f"| {name} | {k} | {_fmt(v)} |" for k, v in figures.items()]
        lines.append("")
    for i, section in enumerate(report["sections"], 1):
        lines += _section_md(i, section)
    return "\n".join(lines) + "\n"


def _section_md(index: int, s: dict) -> list[str]:
    checks = s.get("checks", [])
    passed = sum(c["ok"] for c in checks)
    lines = [
        f"## {index}. {s['name']}: {s['status']} ({s.get('seconds', 0)} s, "
        f"{passed}/{len(checks)} checks held)",
        "",
    ]
    if s.get("error"):
        lines += ["```", str(s["error"]).strip()[-2000:], "```", ""]
    if s.get("figures"):
        lines += ["| figure | value |", "|---|---|"]
        lines += [f"| {k} | {_fmt(v)} |" for k, v in s["figures"].items()]
        lines.append("")
    failed = [c for c in checks if not c["ok"]]
    if failed:
        lines += ["Failed checks:", ""]
        lines += [f"- **{c['name']}**: {c['detail']}" for c in failed]
        lines.append("")
    for name, rows in s.get("tables", {}).items():
        lines += _table_md(name, rows)
    if s.get("notes"):
        lines += [f"- {n}" for n in s["notes"]] + [""]
    return lines


def _table_md(name: str, rows: list[dict]) -> list[str]:
    columns = list(dict.fromkeys(k for row in rows for k in row))
    lines = [f"**{name}**", "", "| " + " | ".join(columns) + " |"]
    lines.append("|" + "---|" * len(columns))
    lines += ["| " + " | ".join(_fmt(row.get(c, "")) for c in columns) + " |" for row in rows]
    return lines + [""]


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (list, tuple)):
        return ", ".join(_fmt(v) for v in value)
    return str(value).replace("|", "\\|")
