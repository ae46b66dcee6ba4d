"""Issue 14 point 5 on SQLite and PostgreSQL, part two (part one: test_audit_trust.py):
completeness and tampering (verify --head against a cut tail, a re-chained table, the
keyed start moved, verify and the writer without the key), the writer's role on
PostgreSQL, and rows written before an upgrade still verifying.
"""

import uuid

import orjson
import pytest
from audit_fixtures import FAST_WRITER, KEY, drain_writer
from click.testing import CliRunner
from sqlalchemy import create_engine, make_url, select, text
from sqlalchemy.exc import DBAPIError

from lorapool import signing
from lorapool.audit_db import (
    AuditWriter,
    ChainTampered,
    DatabaseConfig,
    WriterConfig,
    append_records,
    checkpoint_now,
    create_audit_engine,
    get_request,
    verify_chain,
)
from lorapool.audit_db.chain import GENESIS, link, row_body
from lorapool.audit_db.schema import adapters, completions
from lorapool.cli.audit import audit
from lorapool.cli.audit_writer import audit_writer
from lorapool.records.audit import record_from_dict

pytest_plugins = ["audit_fixtures"]
pytestmark = pytest.mark.integration
LAYOUTS = ("standalone", "cluster")


def _drain(audit_redis, target, prefix=None):
    return drain_writer(audit_redis, target, prefix, consumer="w-trust")


def _cli(target, *args):
    return CliRunner().invoke(audit, [*target.cli_args(), *args], catch_exceptions=False)


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


def test_the_writer_role_chains_ahead_and_keeps_the_rollup(
    writer_role, audit_location, audit_redis
):
    """The writer as deployed: as its role, each batch after the first chained while the
    server inserts the one before, the rollup refreshed from the cells it kept; the
    chain verifies and the rollup is what a rebuild from every row (as the owner) makes."""
    from audit_fixtures import make_adapter, make_record

    from lorapool.audit_db import rollup
    from lorapool.audit_db.database import write_transaction
    from lorapool.audit_db.schema import usage_daily

    engine, spec = writer_role
    adapter = make_adapter()
    tenants = ["acme", None, "n\0l"]
    records = [
        make_record(i, adapter=adapter if i % 3 else None, tenant=tenants[i % 3]) for i in range(20)
    ]
    audit_redis.publish(records)
    config = WriterConfig(
        prefix=audit_redis.prefix,
        shards=audit_redis.shards,
        consumer="w-role",
        batch_size=3,
        rollup_rows=6,
        **FAST_WRITER,
    )
    stats = AuditWriter(audit_redis.conn, engine, config).run(burst=True)
    # (on a cluster the records split unevenly over the shards, and a step on an empty
    # shard reads nothing ahead: fewer batches there are chained ahead, never none)
    assert stats.rows_written == 20 and stats.chained_ahead >= 1 and stats.db_retries == 0
    assert verify_chain(engine, key=KEY).ok

    def cells(on):
        with on.connect() as conn:
            found = conn.execute(select(usage_daily)).mappings().all()
        return {(r["day"], r["dimension"], r["group_key"]): dict(r) for r in found}

    kept = cells(engine)
    owner = create_audit_engine(DatabaseConfig(url=audit_location[1], schema=spec.schema))
    try:
        with write_transaction(owner) as conn:
            rollup.rebuild(conn)
        assert kept == cells(owner) and sum(c["requests"] for c in kept.values()) == 40
    finally:
        owner.dispose()


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
