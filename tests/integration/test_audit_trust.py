"""Issue 14 point 5 on SQLite and PostgreSQL: an audit trail that cannot silently
lose or accept a row.

Exact text (NUL and every other code point), signed records (forged, unsigned
and pre-empting records are dead-lettered, the real one lands), pools in the
key and conflicts recorded, verify --head against a cut tail and a re-chained
table, and the writer's role on PostgreSQL.
"""

import uuid

import orjson
import pytest
from audit_fixtures import FAST_WRITER, KEY
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import create_engine, make_url, select, text
from sqlalchemy.exc import DBAPIError

from lorapool import signing
from lorapool.audit_db import (
    AuditWriter,
    ChainTampered,
    DatabaseConfig,
    SearchFilter,
    WriterConfig,
    append_records,
    checkpoint_now,
    create_audit_engine,
    get_request,
    search,
    verify_chain,
)
from lorapool.audit_db.chain import GENESIS, link, row_body
from lorapool.audit_db.schema import adapters, completions
from lorapool.audit_record import record_from_dict, sign_record
from lorapool.cli.audit import audit
from lorapool.cli.audit_writer import audit_writer
from lorapool.lifecycle.keys import Keys

pytest_plugins = ["audit_fixtures"]
pytestmark = pytest.mark.integration
LAYOUTS = ("standalone", "cluster")
# every Unicode scalar value: surrogates cannot be encoded in UTF-8 (nor reach Redis)
EVERY_CODE_POINT = "".join(chr(c) for c in range(0x110000) if not 0xD800 <= c <= 0xDFFF)


def _drain(audit_redis, target, prefix=None):
    prefix = prefix or audit_redis.prefix
    config = WriterConfig(
        prefix=prefix, shards=audit_redis.shards, consumer="w-trust", **FAST_WRITER
    )
    return AuditWriter(audit_redis.conn, target.engine, config).run(burst=True)


def _dead(audit_redis):
    """(request id, reason) of each dead entry, by request id (a cluster's are shard by
    shard; one stream holds them in the order published)."""
    dead = [
        (orjson.loads(f[b"data"]).get("request_id"), f[b"reason"].decode())
        for _id, f in audit_redis.dead()
    ]
    return sorted(dead, key=lambda d: d[0])


def _cli(target, *args):
    return CliRunner().invoke(audit, [*target.cli_args(), *args], catch_exceptions=False)


# --- exact text -------------------------------------------------------------------


def test_every_code_point_and_nul_round_trip_through_the_writer(audit_target, audit_redis):
    from audit_fixtures import make_record

    record = make_record(1, n=2, text_for=lambda i, k: EVERY_CODE_POINT if k else "a\0\0b\0")
    record["prompt"] = "hello\x00world"
    record["error"] = "bad \x00 byte"
    record["metadata"] = {"tenant": "t\x00nant", "note": "\x00\ufdd0\ufdd1"}
    record["outputs"][0]["stop_reason"] = "\x00stop"
    audit_redis.publish([record])
    stats = _drain(audit_redis, audit_target)
    assert (stats.rows_written, stats.dead_lettered) == (2, 0)
    rows = get_request(audit_target.engine, "req-1")
    assert [r["text"] for r in rows] == ["a\0\0b\0", EVERY_CODE_POINT]
    assert rows[1]["text"].encode() == EVERY_CODE_POINT.encode()  # byte for byte
    assert rows[0]["prompt"] == "hello\x00world" and rows[0]["error"] == "bad \x00 byte"
    assert rows[0]["tenant"] == "t\x00nant" and rows[0]["stop_reason"] == "\x00stop"
    assert rows[0]["request_metadata"] == record["metadata"]
    assert verify_chain(audit_target.engine, key=KEY).ok
    day = {"since": 1_700_000_000.0, "until": 1_700_086_400.0}  # short needles need a window
    found = search(audit_target.engine, SearchFilter(text="\0b", **day))
    assert [(r["request_id"], r["completion_index"]) for r in found] == [("req-1", 0)]
    # the first text's NUL is stored as U+FDD0 U+FDD1, yet only the second has U+FDD1
    found = search(audit_target.engine, SearchFilter(text="\ufdd1", **day))
    assert [r["completion_index"] for r in found] == [1]
    assert search(audit_target.engine, SearchFilter(tenant="t\x00nant"))[0]["prompt"] == (
        "hello\x00world"
    )
    listed = orjson.loads(_cli(audit_target, "request", "req-1", "--format", "json").output)
    assert listed[0]["text"] == "a\0\0b\0"


def test_redelivery_and_conflicts_are_found_for_keys_with_nul_and_the_escapes(audit_target):
    """The append path looks a batch's keys up (on PostgreSQL with one array parameter,
    in the stored, escaped form): a key with NUL, ESC or MARK in its request id or
    pool is found again, so a redelivery is a duplicate and a changed record a
    conflict, never a second row or a refused batch."""
    from audit_fixtures import make_record

    from lorapool.audit_db.rows import prepare
    from lorapool.audit_db.store import append

    pools = ["p\0ool", "p\ufdd0\ufdd1"]
    records = []
    for i, rid in enumerate(["r\0" + uuid.uuid4().hex, "\ufdd0\ufdd1\\\t" + uuid.uuid4().hex]):
        record = make_record(i)
        record["request_id"] = rid
        records.append(record_from_dict(record))
    rows = [row for pool in pools for r in records for row in prepare(r, pool)]
    assert append(audit_target.engine, rows, KEY).written == 4
    again = append(audit_target.engine, rows, KEY)
    assert (again.written, again.duplicates, again.conflicts) == (0, 4, [])
    changed = make_record(0, text_for=lambda i, k: "something else")
    changed["request_id"] = records[0].request_id
    found = append(audit_target.engine, prepare(record_from_dict(changed), pools[0]), KEY)
    assert found.written == 0 and [c.row.key for c in found.conflicts] == [
        (pools[0], records[0].request_id, 0)
    ]
    assert verify_chain(audit_target.engine, key=KEY).ok


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(st.lists(st.text(), min_size=1, max_size=3), st.text())
def test_any_text_round_trips(audit_target, texts, prompt):
    from audit_fixtures import make_record

    rid = uuid.uuid4().hex
    record = make_record(0, n=len(texts), text_for=lambda i, k: texts[k])
    record.update(request_id=rid, prompt=prompt)
    append_records(audit_target.engine, [record_from_dict(record)], key=KEY)
    rows = get_request(audit_target.engine, rid)
    assert [r["text"] for r in rows] == texts and rows[0]["prompt"] == prompt


# --- authenticated records ---------------------------------------------------------


def test_forged_unsigned_and_pre_empting_records_are_dead_lettered(audit_target, audit_redis):
    from audit_fixtures import make_record

    def said(i, what):
        return make_record(i, text_for=lambda _i, _k: what)

    forged = sign_record(said(1, "forged"), b"not-the-key-" * 4, audit_redis.prefix)
    other_pool = sign_record(said(2, "for another pool"), KEY, "another-pool")
    audit_redis.publish([forged, other_pool], signed=False)  # as an attacker puts them
    audit_redis.publish([said(3, "pre-empting")], signed=False)  # unsigned, before the real one
    audit_redis.publish([said(i, f"real {i}") for i in (1, 2, 3)])  # the workers' records
    stats = _drain(audit_redis, audit_target)
    assert (stats.rows_written, stats.dead_lettered, stats.conflicts) == (3, 3, 0)
    texts = {rid: get_request(audit_target.engine, rid)[0]["text"] for rid in ("req-1", "req-2")}
    assert texts == {"req-1": "real 1", "req-2": "real 2"}
    assert get_request(audit_target.engine, "req-3")[0]["text"] == "real 3"
    dead = _dead(audit_redis)
    assert [rid for rid, _ in dead] == ["req-1", "req-2", "req-3"]
    assert "bad signature" in dead[0][1] and "bad signature" in dead[1][1]
    assert "unsigned record" in dead[2][1]
    assert audit_redis.pending() == 0


def test_one_request_id_in_two_pools_gives_two_rows(audit_target, audit_redis):
    from audit_fixtures import make_record

    other = f"{audit_redis.prefix}-b"
    try:
        for prefix in (audit_redis.prefix, other):
            record = make_record(7)
            record["outputs"][0]["text"] = prefix
            record = sign_record(record, KEY, prefix)
            stream = Keys(prefix, audit_redis.shards).for_request("req-7").audit
            audit_redis.conn.xadd(stream, {"data": orjson.dumps(record)})
            assert _drain(audit_redis, audit_target, prefix).rows_written == 1
    finally:  # the writer made every shard's stream (its group's)
        for view in Keys(other, audit_redis.shards).shard_views:
            audit_redis.conn.delete(view.audit)
    rows = get_request(audit_target.engine, "req-7")
    assert sorted((r["pool"], r["text"]) for r in rows) == sorted(
        [(audit_redis.prefix, audit_redis.prefix), (other, other)]
    )
    assert [r["pool"] for r in get_request(audit_target.engine, "req-7", pool=other)] == [other]
    assert verify_chain(audit_target.engine, key=KEY).ok


def test_a_different_record_for_a_stored_key_is_a_reported_conflict(audit_target, audit_redis):
    from audit_fixtures import make_record

    first = make_record(5, text_for=lambda i, k: "first answer")
    second = make_record(5, text_for=lambda i, k: "a different answer")
    ids = audit_redis.publish([first, first, second, second])  # a redelivery is not a conflict
    stats = _drain(audit_redis, audit_target)
    assert (stats.rows_written, stats.duplicates, stats.conflicts) == (1, 1, 2)
    assert get_request(audit_target.engine, "req-5")[0]["text"] == "first answer"
    result = _cli(audit_target, "conflicts", "--format", "json")
    assert result.exit_code == 1
    found = orjson.loads(result.output)
    assert [(c["request_id"], c["completion_index"], c["source"]) for c in found] == [
        ("req-5", 0, ids[2].decode()),
        ("req-5", 0, ids[3].decode()),
    ]
    assert found[0]["refused_row"]["text"] == "a different answer"
    assert found[0]["stored_digest"] != found[0]["refused_digest"]
    assert "req-5" in _cli(audit_target, "conflicts").output


# --- completeness: verify --head ---------------------------------------------------


def _seed(audit_target, audit_redis, count=12):
    from audit_fixtures import make_adapter, make_record

    records = [make_record(i, adapter=make_adapter() if i % 2 else None) for i in range(count)]
    audit_redis.publish(records)
    assert _drain(audit_redis, audit_target).rows_written == count


def _as_owner(target, *statements):
    """What someone with the owner's rights can do: triggers off, rewrite, triggers on."""
    with target.engine.begin() as conn:
        if target.kind == "postgresql":
            conn.execute(text("ALTER TABLE completions DISABLE TRIGGER USER"))
        else:
            conn.execute(text("DROP TRIGGER completions_no_update"))
            conn.execute(text("DROP TRIGGER completions_no_delete"))
        for statement, params in statements:
            conn.execute(text(statement), params)
        if target.kind == "postgresql":
            conn.execute(text("ALTER TABLE completions ENABLE TRIGGER USER"))


def _head(audit_target, tmp_path):
    result = _cli(audit_target, "head", "-o", str(tmp_path / "head.json"))
    assert result.exit_code == 0, result.output
    return tmp_path / "head.json"


def test_a_cut_tail_fails_verify_and_verify_head(audit_target, audit_redis, tmp_path):
    _seed(audit_target, audit_redis)
    head = _head(audit_target, tmp_path)
    assert orjson.loads(head.read_bytes())["seq"] == 12
    assert _cli(audit_target, "verify", "--head", str(head)).exit_code == 0
    assert "checkpoint 2 at row 12" in _cli(audit_target, "checkpoint").output
    _as_owner(audit_target, ("DELETE FROM completions WHERE seq > 9", {}))
    result = _cli(audit_target, "verify")  # the signed checkpoint at row 12 is still there
    assert result.exit_code == 1 and "3 rows are missing from the tail" in result.output
    result = _cli(audit_target, "verify", "--head", str(head))
    assert result.exit_code == 1 and "3 rows are missing from the tail" in result.output


def _rechain(audit_target, key):
    """Rewrite every row's text and re-chain the table with the project's chain function."""
    with audit_target.engine.connect() as conn:
        rows = conn.execute(select(completions).order_by(completions.c.seq)).mappings().all()
        prints = dict(conn.execute(select(adapters.c.pk, adapters.c.fingerprint)).all())
    prev, updates = GENESIS, []
    for row in rows:
        row = {**row, "text": "rewritten"}
        new = link(prev, row["seq"], row_body(row, prints.get(row["adapter_pk"])), key)
        updates.append(
            (
                "UPDATE completions SET text = 'rewritten', prev_hash = :p, row_hash = :h "
                "WHERE seq = :s",
                {"p": prev, "h": new, "s": row["seq"]},
            )
        )
        prev = new
    _as_owner(audit_target, *updates)


@pytest.mark.parametrize("key", [None, b"some-other-key-0123456789abcdef0123"])
def test_a_re_chained_table_fails_verify(audit_target, audit_redis, tmp_path, key):
    _seed(audit_target, audit_redis)
    head = _head(audit_target, tmp_path)
    _rechain(audit_target, key)
    result = _cli(audit_target, "verify")
    assert result.exit_code == 1 and "re-chained without the key" in result.output
    result = _cli(audit_target, "verify", "--head", str(head))
    assert result.exit_code == 1 and "does not have the exported head's hash" in result.output


def test_moving_the_keyed_start_past_the_end_does_not_hide_a_re_chain(audit_target, audit_redis):
    _seed(audit_target, audit_redis)
    _rechain(audit_target, None)
    with audit_target.engine.begin() as conn:  # as the owner: meta rewritten
        if audit_target.kind == "postgresql":
            conn.execute(text("ALTER TABLE audit_meta DISABLE TRIGGER USER"))
        else:
            conn.execute(text("DROP TRIGGER audit_meta_no_update"))
        conn.execute(text("UPDATE audit_meta SET value = '1000'"))
    result = _cli(audit_target, "verify")  # the signed checkpoints still say row 1
    assert result.exit_code == 1 and "(a key downgrade)" in result.output


def test_verify_without_the_key_refuses(audit_target, audit_redis, monkeypatch):
    _seed(audit_target, audit_redis, 3)
    monkeypatch.delenv(signing.KEY_ENV)
    result = _cli(audit_target, "verify")
    assert result.exit_code == 2 and "no audit key" in result.output
    result = _cli(audit_target, "verify", "--insecure-no-key")
    assert result.exit_code == 1 and "needs the audit key" in result.output


def test_a_writer_without_the_key_refuses_to_start(audit_target, audit_redis, monkeypatch):
    from audit_fixtures import make_record

    monkeypatch.delenv(signing.KEY_ENV)
    with pytest.raises(signing.AuditKeyError, match="no audit key"):
        WriterConfig(prefix=audit_redis.prefix)
    shards = ["--shards", str(audit_redis.shards)]
    result = CliRunner().invoke(
        audit_writer, ["--redis-url", audit_redis.url, *shards, *audit_target.cli_args(), "--burst"]
    )
    assert result.exit_code == 2 and "no audit key" in result.output
    # --insecure-no-key starts, but will not extend a chain that is already keyed
    append_records(audit_target.engine, [record_from_dict(make_record(1))], key=KEY)
    insecure = WriterConfig(
        prefix=audit_redis.prefix, shards=audit_redis.shards, insecure_no_key=True, **FAST_WRITER
    )
    with pytest.raises(RuntimeError, match="keyed from row 1"):
        AuditWriter(audit_redis.conn, audit_target.engine, insecure).run(burst=True)


# --- the writer's role (PostgreSQL) ------------------------------------------------


@pytest.fixture
def writer_role(audit_location):
    """A private schema set up by ``audit roles --apply``, and a writer-role engine on it."""
    from lorapool.audit_db.roles import Roles

    kind, url, _schema = audit_location
    if kind != "postgresql":
        pytest.skip("roles are a PostgreSQL feature")
    tag = uuid.uuid4().hex[:10]
    spec = Roles(schema=f"roles_{tag}", owner=f"own_{tag}", writer=f"wr_{tag}", reader=f"rd_{tag}")
    args = ["--db-url", url, "--schema", spec.schema, "roles", "--apply"]
    args += ["--owner", spec.owner, "--writer", spec.writer, "--reader", spec.reader]
    result = CliRunner().invoke(audit, args, catch_exceptions=False)
    writer_url = make_url(url).set(username=spec.writer).render_as_string(hide_password=False)
    engine = create_audit_engine(DatabaseConfig(url=writer_url, schema=spec.schema))
    try:
        assert result.exit_code == 0, result.output
        yield engine, spec
    finally:
        engine.dispose()
        admin = create_engine(url)
        with admin.begin() as conn:
            conn.execute(text(f"DROP SCHEMA IF EXISTS {spec.schema} CASCADE"))
            for role in (spec.owner, spec.writer, spec.reader):
                exists = text("SELECT 1 FROM pg_roles WHERE rolname = :r")
                if conn.execute(exists, {"r": role}).scalar():  # made even if --apply failed
                    conn.execute(text(f"DROP OWNED BY {role}"))
                    conn.execute(text(f"DROP ROLE {role}"))
        admin.dispose()


@pytest.mark.parametrize(
    "statement",
    [
        "ALTER TABLE completions DISABLE TRIGGER USER",
        "ALTER TABLE completions DISABLE TRIGGER completions_append_only",
        "DROP TRIGGER completions_append_only ON completions",
        "DROP TABLE completions",
        "DROP TABLE adapters CASCADE",
        "UPDATE completions SET text = 'x'",
        "DELETE FROM completions",
        "TRUNCATE completions",
        "ALTER TABLE completions ADD COLUMN x int",
        "CREATE TABLE completions_copy (x int)",
    ],
)
def test_the_writer_role_can_insert_and_read_only(writer_role, audit_redis, statement):
    from audit_fixtures import AuditTarget, make_adapter, make_record

    engine, spec = writer_role
    target = AuditTarget("postgresql", "", spec.schema, engine)
    audit_redis.publish([make_record(i, adapter=make_adapter()) for i in range(3)])
    assert _drain(audit_redis, target).rows_written == 3  # as the writer role, COPY included
    refused = pytest.raises(DBAPIError, match="must be owner|permission denied")
    with refused, engine.begin() as conn:
        conn.execute(text(statement))
    assert target.count() == 3 and verify_chain(engine, key=KEY).ok


# --- upgrading a database written before 0002 ---------------------------------------


def test_rows_written_before_the_upgrade_still_verify(audit_location):
    """0001 rows (no pool, unkeyed chain) stay valid; once a key holder adopts them (a
    writer will not key an unkeyed chain on its own), new rows are keyed after them."""
    from audit_fixtures import make_adapter, make_record

    from lorapool.audit_db import migrate
    from lorapool.audit_db.store import chain_head, prepare

    kind, url, schema = audit_location
    engine = create_audit_engine(DatabaseConfig(url=url, schema=schema))
    migrate(engine, "0001")
    old = [prepare(record_from_dict(make_record(i)))[0] for i in range(3)]
    with engine.begin() as conn:  # as the 0001 code wrote them
        prev = GENESIS
        for seq, row in enumerate(old, start=1):
            values = {k: v for k, v in row.values.items() if k != "pool"}
            row_hash = link(prev, seq, row_body({**values, "pool": None}, None))
            values.update(seq=seq, adapter_pk=None, prev_hash=prev, row_hash=row_hash)
            conn.execute(completions.insert(), values)
            prev = row_hash
    migrate(engine)
    target_rows = [record_from_dict(make_record(i, adapter=make_adapter())) for i in (1, 9)]
    with pytest.raises(ChainTampered, match="none of them keyed and no signed checkpoint"):
        append_records(engine, target_rows, pool="p", key=KEY)
    assert checkpoint_now(engine, KEY, adopt=True).seq == 3
    assert append_records(engine, target_rows, pool="p", key=KEY) == 2  # req-1 again: new pool
    report = verify_chain(engine, key=KEY)
    assert report.ok and report.num_rows == 5 and report.keyed_from == 4
    with engine.connect() as conn:
        assert chain_head(conn).seq == 5
    assert [r["pool"] for r in get_request(engine, "req-1")] == [None, "p"]
    engine.dispose()
