"""Compliance queries on a seeded data set, checked against expectations computed
directly from the records (SQLite and PostgreSQL)."""

import statistics

import pytest

from lorapool.audit_db import SearchFilter, append_records, get_request, search, usage
from lorapool.records.audit import record_from_dict

pytest_plugins = ["audit_fixtures"]
pytestmark = pytest.mark.integration
COUNT = 240


@pytest.fixture
def seeded(audit_target):
    from audit_fixtures import random_records

    records = random_records(COUNT, seed=11)
    append_records(audit_target.engine, [record_from_dict(r) for r in records])
    return audit_target.engine, records


def _expected_rows(records, keep=lambda record, output: True):
    """(request_id, completion_index) in arrival order, straight from the records."""
    rows = [
        (r["metrics"]["arrival_time"], r["request_id"], o["index"])
        for r in records
        for o in r["outputs"]
        if keep(r, o)
    ]
    return [(rid, idx) for _t, rid, idx in sorted(rows)]


def _keys(rows):
    return [(r["request_id"], r["completion_index"]) for r in rows]


def test_a_request_by_id_has_every_field(seeded):
    engine, records = seeded
    for record in records[:40]:
        rows = get_request(engine, record["request_id"])
        assert len(rows) == len(record["outputs"])
        for row, output in zip(rows, record["outputs"]):
            assert (row["text"], row["token_ids"], row["finish_reason"]) == (
                output["text"],
                output["token_ids"],
                output["finish_reason"],
            )
            assert row["cumulative_logprob"] == output["cumulative_logprob"]
            adapter = record["adapter"] or {}
            assert row["adapter_name"] == adapter.get("name")
            assert row["adapter_id"] == adapter.get("id")
            assert row["adapter_path"] == adapter.get("path")
            assert row["adapter_sha256"] == adapter.get("sha256")
            assert row["adapter_target_modules"] == adapter.get("target_modules")
            assert row["request_metadata"] == record["metadata"]
            assert row["tenant"] == record["metadata"].get("tenant")
            assert row["sampling_params"] == record["sampling_params"]
            assert row["prompt_token_ids"] == record["prompt_token_ids"]
            assert row["finished_time"] == record["metrics"]["finished_time"]
            assert row["base_model_sha256"] == record["base_model"]["sha256"]
            assert row["error"] == record["error"]
    assert get_request(engine, "no-such-request") == []


def _adapter(record, key):
    return (record["adapter"] or {}).get(key)


SEARCHES = [
    (SearchFilter(adapter_name="sql-lora"), lambda r, o: _adapter(r, "name") == "sql-lora"),
    (SearchFilter(adapter_id=2), lambda r, o: _adapter(r, "id") == 2),
    (
        SearchFilter(adapter_sha256="00010002"),
        lambda r, o: (_adapter(r, "sha256") or "").startswith("00010002"),
    ),
    (SearchFilter(base_model_only=True), lambda r, o: r["adapter"] is None),
    (
        SearchFilter(since=1_700_000_050.0, until=1_700_000_100.0),
        lambda r, o: 1_700_000_050 <= r["metrics"]["arrival_time"] < 1_700_000_100,
    ),
    (SearchFilter(finish_reason="abort"), lambda r, o: o["finish_reason"] == "abort"),
    (SearchFilter(tenant="globex"), lambda r, o: r["metadata"].get("tenant") == "globex"),
    (SearchFilter(text="Hello"), lambda r, o: "Hello" in o["text"]),
    (SearchFilter(text="hello"), lambda r, o: "hello" in o["text"]),
    (
        SearchFilter(
            adapter_name="sql-lora", tenant="acme", finish_reason="stop", since=1_700_000_020.0
        ),
        lambda r, o: (
            _adapter(r, "name") == "sql-lora"
            and r["metadata"].get("tenant") == "acme"
            and o["finish_reason"] == "stop"
            and r["metrics"]["arrival_time"] >= 1_700_000_020
        ),
    ),
]


@pytest.mark.parametrize("flt, keep", SEARCHES)
def test_search_returns_exactly_the_matching_rows(seeded, flt, keep):
    engine, records = seeded
    expected = _expected_rows(records, keep)
    assert expected, "the data set should exercise this filter"
    assert _keys(search(engine, SearchFilter(**{**flt.__dict__, "limit": None}))) == expected
    assert _keys(search(engine, SearchFilter(**{**flt.__dict__, "limit": 5}))) == expected[:5]


def _group(record, by):
    adapter = record["adapter"]
    if by == "tenant":
        return record["metadata"].get("tenant") or "(no tenant)"
    if adapter is None:
        return "(base model)"
    return adapter["name"] if by == "adapter" else f"{adapter['name']}@{adapter['sha256'][:12]}"


def _quantile(values, q):
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def _expected_usage(records, by, since=None, until=None):
    groups = {}
    for r in records:
        arrival = r["metrics"]["arrival_time"]
        if (since is not None and arrival < since) or (until is not None and arrival >= until):
            continue
        groups.setdefault(_group(r, by), []).append(r)
    result = {}
    for key, rs in groups.items():
        latencies = [r["metrics"]["finished_time"] - r["metrics"]["arrival_time"] for r in rs]
        result[key] = (
            len(rs),
            sum(r["metrics"]["num_prompt_tokens"] for r in rs),
            sum(len(o["token_ids"]) for r in rs for o in r["outputs"]),
            sum(
                1
                for r in rs
                if r["error"] or any(o["finish_reason"] == "error" for o in r["outputs"])
            ),
            _quantile(latencies, 50),
            _quantile(latencies, 95),
        )
    return result


@pytest.mark.parametrize("by", ["adapter", "adapter_version", "tenant"])
@pytest.mark.parametrize("period", [(None, None), (1_700_000_030.0, 1_700_000_170.0)])
def test_usage_matches_an_independent_count(seeded, by, period):
    engine, records = seeded
    expected = _expected_usage(records, by, *period)
    rows = usage(engine, by=by, since=period[0], until=period[1])
    assert [row.key for row in rows] == sorted(expected)
    for row in rows:
        want = expected[row.key]
        assert (row.requests, row.prompt_tokens, row.completion_tokens, row.errors) == want[:4]
        counts = (row.requests, row.prompt_tokens, row.completion_tokens, row.errors)
        assert {type(c) for c in counts} == {int}  # JSON-serializable (not Decimal)
        assert row.latency_p50 == pytest.approx(want[4])
        assert row.latency_p95 == pytest.approx(want[5])
