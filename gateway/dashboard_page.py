"""The dashboard as one server-rendered HTML page (no script, no build step): a meta
refresh reloads it. Every value from the pool is escaped (adapter names, texts and
reasons are user input)."""

from __future__ import annotations

import math
import time
from html import escape
from typing import Any
from urllib.parse import quote

STYLE = """body{font:14px system-ui,sans-serif;margin:1.5em;color:#222}
h1{font-size:1.3em}h2{font-size:1.05em;margin-top:1.4em}
table{border-collapse:collapse}
td,th{border-bottom:1px solid #ddd;padding:3px 9px;text-align:left;vertical-align:top}
th{background:#f4f4f4}.num{text-align:right}.muted{color:#777}
.text{max-width:40em;white-space:pre-wrap;word-break:break-word;font-family:monospace}
.queue span{margin-right:1.5em}svg{vertical-align:middle}
tr.stale td{background:#fde2e2;color:#900}form.logout{float:right}"""


def _e(value: Any) -> str:
    return escape("" if value is None else str(value), quote=True)


def _ago(now: float, then: float | None) -> str:
    return "?" if not then else f"{max(0.0, now - then):.1f} s ago"


def _table(
    headers: list[str], rows: list[list[str]], table_id: str, empty: str, marked=frozenset()
) -> str:
    """A table of ``rows`` (each a list of ``<td>``s); the rows whose index is in
    ``marked`` get the class ``stale``."""
    if not rows:
        return f'<p class="muted" id="{table_id}">{_e(empty)}</p>'
    head = "".join(f"<th>{_e(h)}</th>" for h in headers)
    body = "".join(
        ('<tr class="stale">' if i in marked else "<tr>") + "".join(cells) + "</tr>"
        for i, cells in enumerate(rows)
    )
    return f'<table id="{table_id}"><tr>{head}</tr>{body}</table>'


def _td(value: Any, cls: str = "", **data: str) -> str:
    attrs = f' class="{cls}"' if cls else ""
    attrs += "".join(f' data-{k}="{_e(v)}"' for k, v in data.items())
    return f"<td{attrs}>{_e(value)}</td>"


def sparkline(samples: list[tuple], width: int = 240, height: int = 36) -> str:
    """An inline SVG of the queue length over the kept samples."""
    if len(samples) < 2:
        return '<span class="muted">(gathering samples)</span>'
    values = [s[1] for s in samples]
    top, span = max(values) or 1, (samples[-1][0] - samples[0][0]) or 1
    points = " ".join(
        f"{width * (t - samples[0][0]) / span:.1f},{height - height * v / top:.1f}"
        for t, v, _ in samples
    )
    window = f"{span:.0f} s" if span < 120 else f"{span / 60:.0f} min"
    return (
        f'<svg id="sparkline" width="{width}" height="{height}" role="img" '
        f'aria-label="queue length, last {window}, max {top}">'
        f'<polyline fill="none" stroke="#36c" stroke-width="1.5" points="{points}"/></svg>'
        f' <span class="muted">queue length, last {window}, max {top}</span>'
    )


def _kv(worker: dict) -> str:
    usage = worker.get("kv_cache_usage")
    return "-" if not isinstance(usage, int | float) else f"{100 * usage:.0f}%"


def _workers(now: float, workers: list[dict]) -> str:
    rows = [
        [
            _td(w.get("name"), "worker", name=w.get("name", "")),
            _td(w.get("device")),
            _td(w.get("model")),
            _td(", ".join(w.get("adapters") or ()) or "-", "adapters"),
            _td(", ".join(w.get("loaded") or ()) or "-", "loaded"),
            _td(w.get("running"), "num"),
            _td(w.get("waiting"), "num"),
            _td(f"{float(w.get('tokens_per_s') or 0):.1f}", "num"),
            _td(_kv(w), "num kv"),
            _td(_ago(now, w.get("updated")), "heartbeat"),
            _td("stale" if w.get("stale") else "draining" if w.get("draining") else "serving"),
        ]
        for w in workers
    ]
    headers = ["worker", "device", "model", "adapters held", "on device", "running", "waiting"]
    headers += ["tokens/s", "KV cache", "heartbeat", "state"]
    stale = {i for i, w in enumerate(workers) if w.get("stale")}  # marked red
    return _table(headers, rows, "workers", "no worker", stale)


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f} ms" if value < 1 else f"{value:.2f} s"


def _requests(stats: dict | None) -> str:
    """This gateway's last 15 minutes: answers by outcome, latency percentiles."""
    if stats is None:
        return '<p class="muted" id="requests">not served here</p>'
    first, total = stats["first_byte"], stats["total"]
    rows = [
        [_td("requests", ""), _td(stats["requests"], "num", name="requests")],
        [_td("client errors (4xx)"), _td(stats["client_errors"], "num", name="client-errors")],
        [_td("server errors (5xx)"), _td(stats["server_errors"], "num", name="server-errors")],
    ]
    rows += [
        [_td(f"{label} p{q}"), _td(_seconds(values[q]), "num", name=f"{key}-p{q}")]
        for label, key, values in (("first byte", "first", first), ("whole answer", "total", total))
        for q in (50, 90, 99)
    ]
    return _table(["this gateway, last 15 min", ""], rows, "requests", "")


def _queue(queue: dict, history: list) -> str:
    lag = queue["lag"]
    shown = "unknown" if isinstance(lag, float) and math.isnan(lag) else int(lag)
    parts = [
        f'<span>length <b id="queue-length">{_e(queue["length"])}</b></span>',
        f'<span>lag <b id="queue-lag">{_e(shown)}</b></span>',
        f'<span>pending <b id="queue-pending">{_e(queue["pending"])}</b></span>',
        f'<span>dead letters <b id="dead-count">{_e(queue["dead"])}</b></span>',
        f'<span>batch stream <b id="batch-length">{_e(queue.get("batch", 0))}</b></span>',
        f'<span>audit backlog <b id="audit-backlog">{_e(queue.get("audit_backlog", 0))}</b></span>',
    ]
    return f'<p class="queue">{"".join(parts)}</p><p>{sparkline(history)}</p>'


def _hottest(rows: list[dict]) -> str:
    if rows and "requests" in rows[0]:
        cells = [
            [_td(r["adapter"], "adapter"), _td(r["requests"], "num"), _td(r["errors"], "num"),
             _td(_seconds(r["latency_p50"]), "num"), _td(_seconds(r["latency_p95"]), "num")]
            for r in rows
        ]  # fmt: skip
        headers = ["adapter", "requests (15 min)", "errors", "latency p50", "latency p95"]
        return _table(headers, cells, "hottest", "none")
    cells = [[_td(r["adapter"], "adapter"), _td(r["workers"], "num")] for r in rows]
    return _table(["adapter", "workers holding it"], cells, "hottest", "none")


def _audit(now: float, rows: list[dict] | str | None, link: bool, text: bool = True) -> str:
    if rows is None:
        return '<p class="muted" id="audit">no audit database (--audit-db-url)</p>'
    if isinstance(rows, str):
        return f'<p class="muted" id="audit">{_e(rows)}</p>'
    cells = []
    for r in rows:
        rid = r.get("request_id", "")
        shown = _e(rid)
        if link:
            href = "/v1/audit/completions/" + quote(str(rid), safe="")
            shown = f'<a href="{_e(href)}">{shown}</a>'
        cells.append(
            [
                f'<td class="request" data-request="{_e(rid)}">{shown}</td>',
                _td(r.get("adapter_name") or "(base)"),
                _td(r.get("tenant") or "-"),
                _td(r.get("finish_reason")),
                _td(_ago(now, r.get("arrival_time"))),
                *([_td((r.get("text") or "")[:200], "text")] if text else []),
            ]
        )
    headers = ["request", "adapter", "tenant", "finish", "arrived"]
    headers += ["text (first 200)"] if text else []
    return _table(headers, cells, "audit", "no audit rows in the last hour")


def _dead(rows: list[dict] | None) -> str:
    if rows is None:
        return '<p class="muted" id="dead">shown to admins and global auditors</p>'
    cells = [[_td(r.get("id")), _td(r.get("worker")), _td(r.get("reason"), "text")] for r in rows]
    return _table(["entry", "worker", "reason"], cells, "dead", "no dead letters")


LOGOUT = (
    '<form class="logout" method="post" action="/dashboard/logout"><button>Log out</button></form>'
)


def render(snap: dict[str, Any], refresh_s: int, audit_links: bool, logout: bool = False) -> str:
    """The page for one snapshot (``dashboard_data.snapshot``)."""
    now = snap["now"]
    stamp = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(now))
    dead_hooks = _e(snap.get("webhook_dead", 0))
    errors = f'webhook deliveries dead-lettered: <b id="webhook-dead">{dead_hooks}</b>'
    return f"""<!doctype html><html lang="en"><head><meta charset="utf-8">
<meta http-equiv="refresh" content="{refresh_s}">
<title>lorapool: {_e(snap["prefix"])}</title><style>{STYLE}</style></head><body>
{LOGOUT if logout else ""}<h1>lorapool pool <code>{_e(snap["prefix"])}</code></h1>
<p class="muted">{stamp}; refreshes every {refresh_s} s</p>
<h2>Workers</h2>{_workers(now, snap["workers"])}
<h2>Queue</h2>{_queue(snap["queue"], snap["history"])}
<h2>Requests, errors and latency</h2>{_requests(snap.get("requests"))}<p>{errors}</p>
<h2>Hottest adapters</h2>{_hottest(snap["hottest"])}
<h2>Latest audit rows</h2>{_audit(now, snap["audit"], audit_links, snap.get("text", True))}
<h2>Dead letters</h2>{_dead(snap["dead"])}
</body></html>"""
