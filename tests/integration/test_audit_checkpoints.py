"""Signed checkpoints against a table owner without the audit key (SQLite and
PostgreSQL), with no file exported beforehand: the issue's re-chain (edit a row,
re-chain every row, drop ``keyed_from_seq``), a key downgrade, a forged or dropped
checkpoint. ``audit verify`` fails, and the writer refuses to extend such a chain
(it stops, saying why, and acks nothing)."""

import orjson
import pytest
from audit_fixtures import FAST_WRITER, KEY, make_adapter, make_record
from click.testing import CliRunner
from sqlalchemy import select, text

from lorapool.audit_db import AuditWriter, ChainTampered, WriterConfig, verify_chain
from lorapool.audit_db import checkpoints as points
from lorapool.audit_db.chain import GENESIS, logical, row_hash
from lorapool.audit_db.schema import adapters, checkpoints, completions
from lorapool.cli.audit import audit

pytest_plugins = ["audit_fixtures"]
pytestmark = pytest.mark.integration
OTHER_KEY = b"an-owner-made-this-key-0123456789abcdef"


def _writer(audit_redis, target, **config):
    settings = {**FAST_WRITER, **config}
    writer_config = WriterConfig(prefix=audit_redis.prefix, consumer="w-cp", **settings)
    return AuditWriter(audit_redis.conn, target.engine, writer_config)


def _write(audit_redis, target, start: int, count: int, **config):
    records = [
        make_record(i, adapter=make_adapter() if i % 2 else None)
        for i in range(start, start + count)
    ]
    audit_redis.publish(records)
    return _writer(audit_redis, target, **config).run(burst=True)


def _cli(target, *args):
    return CliRunner().invoke(audit, [*target.cli_args(), *args], catch_exceptions=False)


def _as_owner(target, *statements):
    """What the tables' owner can do without the key: triggers off, rewrite, triggers on."""
    tables = ("completions", "checkpoints", "audit_meta")
    with target.engine.begin() as conn:
        for table in tables:
            if target.kind == "postgresql":
                conn.execute(text(f"ALTER TABLE {table} DISABLE TRIGGER USER"))
            else:
                conn.execute(text(f"DROP TRIGGER IF EXISTS {table}_no_update"))
                conn.execute(text(f"DROP TRIGGER IF EXISTS {table}_no_delete"))
        for statement, params in statements:
            conn.execute(text(statement), params)
        for table in tables if target.kind == "postgresql" else ():
            conn.execute(text(f"ALTER TABLE {table} ENABLE TRIGGER USER"))


def _rechain_statements(target, key=None):
    """Edit row 3, then re-chain every row as the project's chain function would,
    with ``key`` (the owner has none: None, or a key of its own)."""
    with target.engine.connect() as conn:
        rows = conn.execute(select(completions).order_by(completions.c.seq)).mappings().all()
        prints = dict(conn.execute(select(adapters.c.pk, adapters.c.fingerprint)).all())
    prev, statements = GENESIS, []
    for row in map(logical, rows):
        if row["seq"] == 3:
            row["text"] = "what the owner wants it to say"
        new = row_hash({**row, "prev_hash": prev}, prev, prints.get(row["adapter_pk"]), key)
        statements.append(
            (
                "UPDATE completions SET text = :t, prev_hash = :p, row_hash = :h WHERE seq = :s",
                {"t": row["text"], "p": prev, "h": new, "s": row["seq"]},
            )
        )
        prev = new
    return statements


def _refused(audit_redis, target, start: int):
    """The writer, run again on new records, refuses and leaves them unacked."""
    audit_redis.publish([make_record(i) for i in range(start, start + 3)])
    with pytest.raises(ChainTampered, match="Refusing to extend"):
        _writer(audit_redis, target).run(burst=True)
    stream = audit_redis.audit(f"req-{start}")
    assert audit_redis.conn.xlen(stream) == 3  # nothing consumed: they wait for an honest chain


@pytest.mark.parametrize("drop_checkpoints", [False, True])
def test_the_owners_re_chain_fails_verify_and_stops_the_writer(
    audit_target, audit_redis, drop_checkpoints
):
    stats = _write(audit_redis, audit_target, 0, 12)
    assert (stats.rows_written, stats.checkpoints) == (12, 1)  # the keyed start's checkpoint
    statements = _rechain_statements(audit_target)
    statements.append(("DELETE FROM audit_meta WHERE name = 'keyed_from_seq'", {}))
    if drop_checkpoints:
        statements.append(("DELETE FROM checkpoints", {}))
    _as_owner(audit_target, *statements)
    _refused(audit_redis, audit_target, 100)
    result = _cli(audit_target, "verify")  # no head or checkpoint file exported earlier
    assert result.exit_code == 1
    if drop_checkpoints:
        assert "none of the 12 rows is keyed" in result.output
    else:
        assert "does not have the hash of signed checkpoint 1" in result.output
        assert "a key downgrade" in result.output
    assert audit_target.count() == 12


def test_a_re_chain_with_a_key_of_the_owners_own_fails(audit_target, audit_redis):
    _write(audit_redis, audit_target, 0, 12)
    _as_owner(audit_target, *_rechain_statements(audit_target, OTHER_KEY))
    result = _cli(audit_target, "verify", "--since-checkpoint")
    assert result.exit_code == 1 and "signed checkpoint 1" in result.output
    _refused(audit_redis, audit_target, 100)


def test_moving_the_keyed_start_is_a_key_downgrade(audit_target, audit_redis):
    _write(audit_redis, audit_target, 0, 6)
    _as_owner(audit_target, ("UPDATE audit_meta SET value = '7'", {}))
    result = _cli(audit_target, "verify")
    assert result.exit_code == 1 and "(a key downgrade)" in result.output
    _refused(audit_redis, audit_target, 100)


def test_a_forged_or_missing_checkpoint_fails_verify(audit_target, audit_redis):
    _write(audit_redis, audit_target, 0, 4)
    for start in (4, 8, 12):  # a checkpoint every 4 rows
        _write(audit_redis, audit_target, start, 4, checkpoint_rows=4)
    with audit_target.engine.connect() as conn:
        made = points.every(conn)
    assert [(p.id, p.seq) for p in made] == [(1, 4), (2, 8), (3, 12), (4, 16)]
    assert verify_chain(audit_target.engine, key=KEY).ok
    forged = points.make(made[1], 10, "f" * 64, 1, 0.0, OTHER_KEY)
    _as_owner(audit_target, ("DELETE FROM checkpoints WHERE id = 3", {}))
    report = verify_chain(audit_target.engine, key=KEY)
    assert not report.ok and "checkpoint 3 is missing" in report.problem
    with audit_target.engine.begin() as conn:
        conn.execute(checkpoints.insert(), {**forged.__dict__, "id": 3})  # inserts are allowed
    report = verify_chain(audit_target.engine, key=KEY)
    assert not report.ok and "checkpoint 3 is not signed with the audit key" in report.problem


def test_checkpoints_every_k_rows_as_files(audit_target, audit_redis, tmp_path):
    folder = tmp_path / "worm"
    stats = _write(audit_redis, audit_target, 0, 10, checkpoint_rows=4, checkpoint_dir=str(folder),
                   batch_size=3)  # fmt: skip
    assert stats.rows_written == 10
    files = sorted(folder.iterdir())
    with audit_target.engine.connect() as conn:
        made = points.every(conn)
    assert [p.seq for p in made] == [3, 9] and len(files) == 2  # batches of 3: 3, 6, 9, 10
    assert [orjson.loads(f.read_bytes())["checkpoint"]["seq"] for f in files] == [
        p.seq for p in made
    ]
    assert _cli(audit_target, "verify", "--head", str(files[-1])).exit_code == 0
    forged = points.Checkpoint.from_json(files[-1].read_bytes()).signed(OTHER_KEY)
    (tmp_path / "forged.json").write_bytes(forged.to_json())
    result = _cli(audit_target, "verify", "--head", str(tmp_path / "forged.json"))
    assert result.exit_code == 1 and "checkpoint file is not signed" in result.output
