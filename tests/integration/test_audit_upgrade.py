"""Upgrading a database the code at revision 0002 wrote (tests/audit_db/data/v0002.json,
made by that code) to the newest revision, on SQLite and PostgreSQL: every old row
still verifies and reads back exactly, the writer goes on from it (compact rows,
signed checkpoints) and the whole chain verifies."""

import importlib.util
import time
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
    exact_text,
    get_request,
    head_revision,
    list_conflicts,
    migrate,
    partitions,
    search,
    verify_chain,
)
from lorapool.audit_db.chain import GENESIS, row_hash
from lorapool.audit_db.rows import prepare
from lorapool.audit_db.usage import usage
from lorapool.records.audit import record_from_dict

pytest_plugins = ["audit_fixtures"]
pytestmark = pytest.mark.integration
V0002 = Path(__file__).parents[1] / "audit_db" / "data" / "v0002.json"
TABLES = ("adapters", "completions", "conflicts", "audit_meta")
TEXT = {"pool", "request_id", "base_model_name", "base_model_sha256", "prompt", "text",
        "tenant", "worker", "error"}  # fmt: skip


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


def test_int4_token_arrays_become_packed_bytes_and_still_verify(audit_location):
    """Rows written under 0003-0005 (token ids as int4[] on PostgreSQL) upgrade to 0006."""
    kind, url, schema = audit_location
    if kind != "postgresql":
        pytest.skip("SQLite stored packed bytes from the start")
    engine = create_audit_engine(DatabaseConfig(url=url, schema=schema))
    migrate(engine, "0005")
    records = [make_record(i, adapter=make_adapter(), n=2) for i in range(6)]
    records[2]["outputs"][1]["token_ids"] = []  # an empty list too
    rows = [r for record in records for r in prepare(record_from_dict(record), "p")]
    head, prev, stored = 0, GENESIS, []
    meta = MetaData()
    meta.reflect(engine)
    table = meta.tables["completions"]
    with engine.begin() as conn:  # as the 0005 code stored them: int4[] columns
        conn.execute(
            text("SELECT audit_ensure_period(:p)"), {"p": partitions.period_of(time.time())}
        )
        conn.execute(meta.tables["audit_meta"].insert(), {"name": "keyed_from_seq", "value": "1"})
        pk = conn.execute(meta.tables["adapters"].insert().returning(meta.tables["adapters"].c.pk),
                          {k: v for k, v in rows[0].adapter.items()}).scalar()  # fmt: skip
        for row in rows:
            head += 1
            values = {**row.values, "seq": head, "adapter_pk": pk, "chain_version": 2,
                      "period": partitions.period_of(time.time())}  # fmt: skip
            values["row_hash"] = row_hash(values, prev, row.adapter["fingerprint"], KEY)
            values["prev_hash"], prev = prev, values["row_hash"]
            values["prompt_tokens"] = values.pop("prompt_token_ids")
            values["output_tokens"] = values.pop("token_ids")
            values = {k: exact_text.encode(v) if k in TEXT and v is not None else v
                      for k, v in values.items()}  # fmt: skip
            conn.execute(table.insert(), values)
            stored.append(row)
    assert migrate(engine) == head_revision()
    assert checkpoint_now(engine, KEY).seq == head
    report = verify_chain(engine, key=KEY)
    assert report.ok and report.num_rows == head, report.describe_failure()
    back = get_request(engine, "req-2")
    assert [r["token_ids"] for r in back] == [o["token_ids"] for o in records[2]["outputs"]]
    assert back[0]["prompt_token_ids"] == records[2]["prompt_token_ids"]
    engine.dispose()


COMPRESSION = (
    "SELECT c.relname, a.attname, a.attcompression FROM pg_attribute a "
    "JOIN pg_class c ON c.oid = a.attrelid JOIN pg_namespace n ON n.oid = c.relnamespace "
    "WHERE n.nspname = current_schema() AND c.relname LIKE 'completions%' "
    "AND c.relkind IN ('r', 'p') "
    "AND a.attname IN ('prompt', 'text', 'prompt_tokens', 'output_tokens')"
)


def test_0007_compresses_long_columns_with_lz4_in_old_and_new_partitions(audit_location):
    """Rows written under 0006 (pglz) still verify after 0007; the partitions there were
    and the ones made after it (a later month) compress new values with lz4."""
    kind, url, schema = audit_location
    if kind != "postgresql":
        pytest.skip("SQLite does not compress")
    engine = create_audit_engine(DatabaseConfig(url=url, schema=schema))
    migrate(engine, "0006")
    records = [make_record(i, adapter=make_adapter(), n=2) for i in range(4)]
    append_records(engine, [record_from_dict(r) for r in records], "p", KEY)
    with engine.connect() as conn:
        if not conn.execute(text("SELECT 'lz4' = ANY(enumvals) FROM pg_settings "
                                 "WHERE name = 'default_toast_compression'")).scalar():  # fmt: skip
            pytest.skip("this server has no lz4")
    assert migrate(engine) == head_revision()
    later = partitions.next_period(partitions.next_period(partitions.period_of(time.time())))
    with engine.begin() as conn:
        assert conn.execute(text("SELECT audit_ensure_period(:p)"), {"p": later}).scalar()
        found = conn.execute(text(COMPRESSION)).all()
    tables = {table for table, _, _ in found}
    assert f"{partitions.PARTITION_PREFIX}{later}" in tables and len(tables) >= 4
    assert not [f for f in found if f[2] != "l"]
    long = lambda i, k: f"{i}/{k} " + "a long output " * 300  # noqa: E731 (past TOAST's 2 kB)
    more = [make_record(i, adapter=make_adapter(), n=2, text_for=long) for i in range(4, 8)]
    append_records(engine, [record_from_dict(r) for r in more], "p", KEY)
    with engine.connect() as conn:
        query = "SELECT DISTINCT pg_column_compression(text) FROM completions WHERE seq > 8"
        assert conn.execute(text(query)).scalars().all() == ["lz4"]
    report = verify_chain(engine, key=KEY)
    assert report.ok and report.num_rows == 16, report.describe_failure()
    assert get_request(engine, "req-5")[1]["text"] == more[1]["outputs"][1]["text"]
    engine.dispose()
