"""The dashboard page escapes every value from the pool: worker names, devices, adapter
names, request ids, audit texts, dead-letter reasons are user input. Python's own HTML
parser reads the page back: no element the values did not come with, every value shown
as its text."""

from __future__ import annotations

import math
from html.parser import HTMLParser

from lorapool.gateway.dashboard_page import render

HOSTILE = '<script>alert("x")</script><img src=x onerror=alert(1)> & "quoted" \'single\''


class Reader(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags, self.text = [], []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)

    def handle_data(self, data):
        self.text.append(data)


def snapshot(value: str) -> dict:
    now = 1_800_000_000.0
    worker = {"name": value, "device": value, "model": value, "adapters": [value]}
    worker |= {"running": 1, "waiting": 0, "tokens_per_s": 3.0, "updated": now}
    worker |= {"kv_cache_usage": 0.25, "stale": False}
    stale = {**worker, "name": "gone", "updated": now - 60, "stale": True}
    row = {"request_id": value, "adapter_name": value, "tenant": value, "text": value}
    row |= {"finish_reason": "stop", "arrival_time": now - 1}
    return {
        "now": now,
        "prefix": "pool",
        "workers": [worker, stale],
        "queue": {
            "length": 3,
            "pending": 1,
            "lag": math.nan,
            "dead": 1,
            "batch": 7,
            "audit_backlog": 4,
        },
        "history": [(now - 4, 1, 0), (now - 2, 3, 1), (now, 2, 0)],
        "requests": {
            "requests": 9,
            "client_errors": 2,
            "server_errors": 1,
            "first_byte": {50: 0.01, 90: 0.2, 99: 1.5},
            "total": {50: 0.5, 90: None, 99: None},
        },
        "webhook_dead": 3,
        "hottest": [
            {"adapter": value, "requests": 5, "errors": 1, "latency_p50": 0.4, "latency_p95": 2.5}
        ],
        "audit": [row],
        "dead": [{"id": "1-0", "worker": value, "reason": value}],
    }


def test_every_value_is_escaped():
    page = render(snapshot(HOSTILE), 5, audit_links=True)
    reader = Reader()
    reader.feed(page)
    assert "script" not in reader.tags and "img" not in reader.tags
    shown = "".join(reader.text)
    # worker, device, model, adapters, hottest, audit request/adapter/tenant/text, dead x2
    assert shown.count(HOSTILE) >= 11
    assert 'href="/v1/audit/completions/%3Cscript%3E' in page
    assert 'id="queue-lag">unknown<' in page  # NaN lag: Redis could not say
    assert 'id="batch-length">7<' in page


def test_no_links_without_the_audit_routes():
    page = render(snapshot("w1"), 5, audit_links=False)
    assert "<a " not in page and 'data-request="w1"' in page


def test_a_failed_audit_database_is_said_escaped():
    snap = snapshot("w1") | {"audit": "the audit database failed: <OperationalError>"}
    page = render(snap, 5, audit_links=True)
    assert "failed: &lt;OperationalError&gt;" in page and 'id="workers"' in page


def test_operator_panes_stale_heartbeats_and_no_text_for_admins():
    snap = snapshot("w1")
    page = render(snap, 5, audit_links=True)
    assert '<tr class="stale"><td class="worker" data-name="gone">' in page
    assert '<tr><td class="worker" data-name="w1">' in page
    assert 'class="num kv">25%<' in page and 'id="audit-backlog">4<' in page
    for shown in ('data-name="server-errors">1<', 'data-name="first-p99">1.50 s<',
                  'data-name="first-p50">10 ms<', 'data-name="total-p90">-<',
                  'id="webhook-dead">3<', ">2.50 s<"):  # fmt: skip
        assert shown in page, shown
    hidden = render(snap | {"text": False}, 5, audit_links=True)
    assert (
        "text (first 200)" not in hidden
        and 'class="text"' not in hidden.split('id="audit"')[1].split("</table>")[0]
    )
