"""Retention that keeps the chain (PostgreSQL: months are partitions): rows written
over three months, the two older archived with ``lorapool audit archive``; each
archive verifies offline, the rows left online verify from the last archive's end,
the writer goes on, and a tampered archive file, a forged manifest or a month
dropped without an archive fail."""

import gzip
import shutil

import orjson
import pytest
from audit_fixtures import KEY, make_adapter, make_record
from click.testing import CliRunner
from sqlalchemy import text

from lorapool.audit_db import append_records, partitions, verify_chain
from lorapool.audit_db.archive import verify_file
from lorapool.audit_db.archive_manifest import Manifest
from lorapool.audit_db.rows import prepare
from lorapool.audit_db.store import append
from lorapool.audit_db.usage import usage
from lorapool.cli.audit import audit
from lorapool.records.audit import record_from_dict

pytest_plugins = ["audit_fixtures"]
pytestmark = pytest.mark.integration
MONTHS = {202601: 1_767_225_600.0, 202602: 1_769_904_000.0, 202603: 1_772_323_200.0}


def _cli(target, *args):
    return CliRunner().invoke(audit, [*target.cli_args(), *args], catch_exceptions=False)


def _write_month(target, start: int, count: int, at: float) -> None:
    """Records written as a writer would have written them at ``at``."""
    for i in range(start, start + count, 5):
        records = [
            make_record(
                k, adapter=make_adapter() if k % 2 else None, arrival=at + k, n=1 + (k % 3 == 0)
            )
            for k in range(i, min(i + 5, start + count))
        ]
        rows = [row for r in records for row in prepare(record_from_dict(r), "p", now=at + i)]
        append(target.engine, rows, KEY, now=at + i)


@pytest.fixture
def three_months(audit_target):
    if audit_target.kind != "postgresql":
        pytest.skip("archiving is PostgreSQL's (SQLite keeps every row)")
    for n, at in enumerate(MONTHS.values()):
        _write_month(audit_target, 100 * n, 20, at)
    return audit_target


def test_archived_months_verify_offline_and_the_rest_online(three_months, tmp_path):
    target = three_months
    before = usage(target.engine, "tenant", exact=True)
    result = _cli(target, "archive", "--before", "2026-03", "--out", str(tmp_path))
    assert result.exit_code == 0, result.output
    files = sorted(tmp_path.glob("*.jsonl.gz"))
    assert [f.name.split("-")[1] for f in files] == ["202601", "202602"]
    with target.engine.connect() as conn:
        assert 202601 not in partitions.existing(conn) and 202603 in partitions.existing(conn)
        first = conn.execute(text("SELECT min(seq) FROM completions")).scalar()
    for f in files:  # offline: no database
        checked = _cli(target, "verify-archive", str(f))
        assert checked.exit_code == 0 and "OK: month" in checked.output, checked.output
    manifests = [
        Manifest.from_json(f.with_name(f.name + ".manifest.json").read_bytes()) for f in files
    ]
    assert manifests[0].first_seq == 1 and manifests[1].first_seq == manifests[0].last_seq + 1
    assert manifests[1].last_seq + 1 == first and manifests[1].start_hash == manifests[0].end_hash
    report = verify_chain(target.engine, key=KEY)  # online, from the last archive's end
    assert report.ok, report.describe_failure()
    assert (report.start_seq, report.archived_rows) == (first - 1, first - 1)
    assert _cli(target, "verify", "--since-checkpoint").exit_code == 0
    # usage of the archived months survives in the rollup
    assert [(u.key, u.requests) for u in usage(target.engine, "tenant", exact=False)] == [
        (u.key, u.requests) for u in before
    ]
    # the writer goes on after the archive
    more = [record_from_dict(make_record(900 + i)) for i in range(3)]
    assert append_records(target.engine, more, pool="p", key=KEY) == 3
    assert verify_chain(target.engine, key=KEY).ok


def _tampered_copy(src, dst, change):
    with gzip.open(src, "rb") as f:
        lines = [orjson.loads(line) for line in f]
    change(lines)
    with gzip.open(dst, "wb") as f:
        for line in lines:
            f.write(orjson.dumps(line) + b"\n")


def test_a_tampered_archive_or_a_dropped_month_fails(three_months, tmp_path):
    target = three_months
    assert _cli(target, "archive", "--before", "2026-02", "--out", str(tmp_path)).exit_code == 0
    [archive] = tmp_path.glob("*.jsonl.gz")
    manifest = archive.with_name(archive.name + ".manifest.json")
    assert verify_file(archive, KEY).ok

    def edit_a_row(lines):
        row = next(line for line in lines if line["kind"] == "row")
        row["text"] = "rewritten"

    forged = tmp_path / "forged" / archive.name
    forged.parent.mkdir()
    _tampered_copy(archive, forged, edit_a_row)
    shutil.copy(manifest, forged.with_name(manifest.name))
    report = verify_file(forged, KEY)
    assert not report.ok and "size or sha256" in report.problem
    # the owner re-signs nothing without the key: a manifest made for the edited file fails
    fake = Manifest.from_json(manifest.read_bytes())
    with forged.open("rb") as f:
        import hashlib

        digest = hashlib.sha256(f.read()).hexdigest()
    fake = Manifest(
        **{**fake.signed_fields(), "file_sha256": digest, "file_bytes": forged.stat().st_size}
    )
    forged.with_name(manifest.name).write_bytes(
        fake.signed(b"the-owners-own-key-0123456789abcdef").to_json()
    )
    assert "not signed with the audit key" in verify_file(forged, KEY).problem
    result = _cli(target, "verify-archive", str(forged))
    assert result.exit_code == 1 and "not signed" in result.output
    # February's partition dropped by the owner, without an archive
    with target.engine.begin() as conn:
        conn.execute(text("DROP TABLE completions_p202602"))
    result = _cli(target, "verify")
    assert result.exit_code == 1 and "no signed archive accounts for them" in result.output


def test_the_newest_month_stays_and_sqlite_keeps_every_row(audit_target, tmp_path):
    if audit_target.kind == "postgresql":
        _write_month(audit_target, 0, 5, MONTHS[202601])
        result = _cli(audit_target, "archive", "--before", "2026-02", "--out", str(tmp_path))
        assert result.exit_code == 1 and "newest row: it stays online" in result.output
    else:
        append_records(audit_target.engine, [record_from_dict(make_record(1))], key=KEY)
        result = _cli(audit_target, "archive", "--before", "2030-01", "--out", str(tmp_path))
        assert result.exit_code == 1 and "SQLite" in result.output
    assert (
        _cli(audit_target, "archive", "--before", "2026-13", "--out", str(tmp_path)).exit_code == 2
    )
