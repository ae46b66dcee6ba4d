"""Upgrading a database the code at revision 0002 wrote (tests/audit_db/data/v0002.json,
made by that code) to the newest revision, on SQLite and PostgreSQL: every old row
still verifies and reads back exactly, the writer goes on from it (compact rows,
signed checkpoints) and the whole chain verifies."""

import importlib.util
from pathlib import Path

import orjson
import pytest
from audit_fixtures import KEY, make_adapter, make_record
from sqlalchemy import JSON, MetaData, text

from lorapool.audit_db import (
    DatabaseConfig,
    SearchFilter,
    append_records,
    checkpoint_now,
    checkpoints,
    create_audit_engine,
    get_request,
    head_revision,
    list_conflicts,
    migrate,
    partitions,
    search,
    verify_chain,
)
from lorapool.audit_db.usage import usage
from lorapool.audit_record import record_from_dict

pytest_plugins = ["audit_fixtures"]
pytestmark = pytest.mark.integration
V0002 = Path(__file__).parents[1] / "audit_db" / "data" / "v0002.json"
TABLES = ("adapters", "completions", "conflicts", "audit_meta")


def load_v0002(engine, kind: str) -> dict:
    """The 0002 tables with exactly the rows the 0002 code stored."""
    assert migrate(engine, "0002") == "0002"
    dump = orjson.loads(V0002.read_bytes())
    meta = MetaData()
    meta.reflect(engine)
    with engine.begin() as conn:
        for name in TABLES:
            table = meta.tables[name]
            json_columns = [c.name for c in table.columns if isinstance(c.type, JSON)]
            rows = [dict(r) for r in dump[name]]
            for row in rows if kind == "postgresql" else ():
                for column in json_columns:  # the dump has SQLite's JSON text
                    row[column] = None if row[column] is None else orjson.loads(row[column])
            conn.execute(table.insert(), rows)
        if kind == "postgresql":
            for name in ("adapters", "conflicts"):
                pk = "pk"
                conn.execute(
                    text(f"SELECT setval(pg_get_serial_sequence('{name}', '{pk}'), "
                         f"(SELECT max({pk}) FROM {name}))")
                )  # fmt: skip
    return dump


def _records_0002() -> list[dict]:
    """The records the 0002 code was given (from the script that made the dump)."""
    spec = importlib.util.spec_from_file_location("make_v0002", V0002.with_name("make_v0002.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.records()


@pytest.mark.parametrize("first", ["checkpoint", "writer"])
def test_a_0002_database_upgrades_verifies_and_grows(audit_location, first):
    records = _records_0002
    kind, url, schema = audit_location
    engine = create_audit_engine(DatabaseConfig(url=url, schema=schema))
    dump = load_v0002(engine, kind)
    assert migrate(engine) == head_revision()
    report = verify_chain(engine, key=KEY)  # every row verifies; the checkpoint is to come
    assert (report.first_bad, report.num_rows, report.keyed_from) == (None, 30, 1)
    assert "yet the chain has no signed checkpoint" in report.problem
    if first == "checkpoint":  # `audit checkpoint`; else the writer's first batch makes it
        assert checkpoint_now(engine, KEY).seq == 30
        report = verify_chain(engine, key=KEY)
        assert report.ok, report.describe_failure()
        assert (report.num_rows, report.num_checkpoints) == (30, 1)
    for record in records()[:6]:
        rows = get_request(engine, record["request_id"])
        assert [r["text"] for r in rows] == [o["text"] for o in record["outputs"]]
        assert rows[0]["prompt_token_ids"] == record["prompt_token_ids"]
        assert [r["token_ids"] for r in rows] == [o["token_ids"] for o in record["outputs"]]
    assert [c["refused_row"]["text"] for c in list_conflicts(engine)] == ["a different answer"]
    # the migration filled the rollup and the text index from the rows already there
    for by in ("adapter", "tenant"):
        rolled, exact = usage(engine, by, exact=False), usage(engine, by, exact=True)
        assert [(u.key, u.requests, u.completion_tokens) for u in rolled] == [
            (u.key, u.requests, u.completion_tokens) for u in exact
        ]
    found = search(engine, SearchFilter(text="answer 5.0 \0 with", limit=None))
    assert [r["request_id"] for r in found] == ["req-5"]

    new = [make_record(100 + i, adapter=make_adapter("chat-lora", 2, 1)) for i in range(5)]
    assert append_records(engine, [record_from_dict(r) for r in new], key=KEY) == 5
    report = verify_chain(engine, key=KEY)
    assert report.ok, report.describe_failure()
    assert (report.num_rows, report.head_seq) == (35, 35)
    with engine.connect() as conn:
        versions = dict(conn.execute(text("SELECT seq, chain_version FROM completions")).all())
        made = [p.seq for p in checkpoints.every(conn)]
        assert made == [30]  # `audit checkpoint`'s, or the writer's at the end of 2023-11
        assert {versions[s] for s in range(1, 31)} == {1} and versions[31] == 2
        assert partitions.period_of(dump["completions"][0]["written_at"]) in partitions.existing(
            conn
        )
    assert get_request(engine, "req-104")[0]["token_ids"] == new[4]["outputs"][0]["token_ids"]
    engine.dispose()
