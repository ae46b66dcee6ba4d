"""Tamper evidence: append-only tables and the hash chain, on SQLite and PostgreSQL."""

import threading

import pytest
from audit_fixtures import KEY
from sqlalchemy import select, text
from sqlalchemy.exc import DBAPIError

from lorapool.audit_db import append_records, verify_chain
from lorapool.audit_db.chain import logical, row_hash
from lorapool.audit_db.schema import completions
from lorapool.records.audit import record_from_dict

pytest_plugins = ["audit_fixtures"]
pytestmark = pytest.mark.integration


def _seed(target, count=50):
    from audit_fixtures import make_adapter, make_record

    adapters = [None, make_adapter("a", 1), make_adapter("b", 2)]
    records = [make_record(i, adapter=adapters[i % 3], n=1 + i % 2) for i in range(count)]
    append_records(target.engine, [record_from_dict(r) for r in records], key=KEY)


def _bypassing_triggers(target, *statements):
    """Run statements as an attacker with database access would: triggers off."""
    with target.engine.begin() as conn:
        if target.kind == "postgresql":
            conn.execute(text("ALTER TABLE completions DISABLE TRIGGER USER"))
            conn.execute(text("ALTER TABLE adapters DISABLE TRIGGER USER"))
        else:
            for name in ("completions_no_update", "completions_no_delete", "adapters_no_update"):
                conn.execute(text(f"DROP TRIGGER {name}"))
        for statement, params in statements:
            conn.execute(text(statement), params)
        if target.kind == "postgresql":
            conn.execute(text("ALTER TABLE completions ENABLE TRIGGER USER"))
            conn.execute(text("ALTER TABLE adapters ENABLE TRIGGER USER"))


def _seq_of(target, request_id, index):
    with target.engine.connect() as conn:
        return conn.execute(
            select(completions.c.seq).where(
                completions.c.request_id == request_id, completions.c.completion_index == index
            )
        ).scalar_one()


@pytest.mark.parametrize(
    "statement",
    [
        "UPDATE completions SET text = 'x' WHERE seq = 3",
        "DELETE FROM completions WHERE seq = 3",
        "UPDATE adapters SET sha256 = 'x'",
        "DELETE FROM adapters",
    ],
)
def test_updates_and_deletes_are_rejected(audit_target, statement):
    _seed(audit_target, 5)
    with pytest.raises(DBAPIError, match="append-only"), audit_target.engine.begin() as conn:
        conn.execute(text(statement))
    assert audit_target.count() == 7


def test_truncate_is_rejected_on_postgresql(audit_target):
    if audit_target.kind != "postgresql":
        pytest.skip("SQLite has no TRUNCATE")
    _seed(audit_target, 5)
    with pytest.raises(DBAPIError, match="append-only"), audit_target.engine.begin() as conn:
        conn.execute(text("TRUNCATE completions"))


def test_an_untouched_chain_verifies(audit_target):
    _seed(audit_target)
    report = verify_chain(audit_target.engine, key=KEY)
    assert report.ok and report.num_rows == 75 and report.num_adapters == 2
    assert report.head_seq == 75 and len(report.head_hash) == 64


def test_changed_output_text_is_named(audit_target):
    _seed(audit_target)
    seq = _seq_of(audit_target, "req-17", 1)
    _bypassing_triggers(
        audit_target,
        (
            "UPDATE completions SET text = :t WHERE request_id = 'req-17' AND completion_index = 1",
            {"t": "something the model never said"},
        ),
    )
    bad = verify_chain(audit_target.engine, key=KEY).first_bad
    assert (bad.table, bad.key, bad.request_id, bad.completion_index) == (
        "completions",
        seq,
        "req-17",
        1,
    )
    assert "does not match its row_hash" in bad.reason


@pytest.mark.parametrize(
    "packed",
    [
        "x'0100000002000000'",  # other ids (a walk hashes the stored bytes as they are)
        "x'01000000020000'",  # not whole int32s: no list could be made of them
    ],
)
def test_changed_compact_token_ids_are_named(audit_target, packed):
    _seed(audit_target)
    seq = _seq_of(audit_target, "req-17", 1)
    packed = packed if audit_target.kind == "sqlite" else "'\\x" + packed[2:]
    statement = f"UPDATE completions SET output_tokens = {packed} WHERE seq = :s"
    _bypassing_triggers(audit_target, (statement, {"s": seq}))
    bad = verify_chain(audit_target.engine, key=KEY).first_bad
    assert (bad.key, bad.request_id) == (seq, "req-17")
    assert "does not match its row_hash" in bad.reason


def test_rehashing_a_changed_row_with_the_key_breaks_the_next_link(audit_target):
    _seed(audit_target)
    seq = _seq_of(audit_target, "req-20", 0)
    with audit_target.engine.connect() as conn:
        row = dict(
            conn.execute(select(completions).where(completions.c.seq == seq)).mappings().one()
        )
    row["text"] = "forged"
    # the adapter of req-20 (20 % 3 == 2) is "b"; recompute its fingerprint from the table
    with audit_target.engine.connect() as conn:
        fingerprint = conn.execute(
            text("SELECT fingerprint FROM adapters WHERE pk = :pk"), {"pk": row["adapter_pk"]}
        ).scalar_one()
    forged_hash = row_hash(logical(row), row["prev_hash"], fingerprint, KEY)  # any chain version
    _bypassing_triggers(
        audit_target,
        (
            "UPDATE completions SET text = 'forged', row_hash = :h WHERE seq = :s",
            {"h": forged_hash, "s": seq},
        ),
    )
    bad = verify_chain(audit_target.engine, key=KEY).first_bad
    assert bad.key == seq + 1 and "prev_hash" in bad.reason


def test_a_deleted_row_is_named(audit_target):
    _seed(audit_target)
    _bypassing_triggers(audit_target, ("DELETE FROM completions WHERE seq = 30", {}))
    bad = verify_chain(audit_target.engine, key=KEY).first_bad
    assert bad.key == 31 and "missing" in bad.reason


def test_a_changed_adapter_is_named(audit_target):
    _seed(audit_target)
    _bypassing_triggers(
        audit_target, ("UPDATE adapters SET sha256 = :h WHERE name = 'b'", {"h": "0" * 64})
    )
    bad = verify_chain(audit_target.engine, key=KEY).first_bad
    assert bad.table == "adapters" and "fingerprint" in bad.reason


def test_concurrent_appends_keep_the_chain_valid(audit_target):
    from audit_fixtures import make_adapter, make_record

    def work(offset):
        for batch in range(10):
            start = offset + batch * 20
            records = [
                make_record(i, adapter=make_adapter("c", 3)) for i in range(start, start + 20)
            ]
            append_records(audit_target.engine, [record_from_dict(r) for r in records], key=KEY)

    threads = [threading.Thread(target=work, args=(t * 1000,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    report = verify_chain(audit_target.engine, key=KEY)
    assert report.ok and report.num_rows == 800
