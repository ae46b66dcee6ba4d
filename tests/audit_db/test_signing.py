"""The audit key and record signatures (no server)."""

import copy

import pytest

from lorapool import signing
from lorapool.records.audit import RecordError, check_signature, parse_record, sign_record

pytest_plugins = ["audit_fixtures"]
KEY = b"k" * 40


def test_key_from_env_and_from_a_file(tmp_path):
    assert signing.key_from_env({}) is None
    assert signing.key_from_env({signing.KEY_ENV: "x" * 32}) == b"x" * 32
    path = tmp_path / "audit.key"
    written = signing.write_key_file(path)
    assert (path.stat().st_mode & 0o777) == 0o600 and len(written) == 64
    assert signing.write_key_file(path) == written  # made once
    assert signing.key_from_env({signing.KEY_FILE_ENV: str(path)}) == written


@pytest.mark.parametrize(
    "env, message",
    [
        ({signing.KEY_ENV: "short"}, "LORAPOOL_AUDIT_KEY: the audit key has 5 characters"),
        ({signing.KEY_FILE_ENV: "/nonexistent/key"}, "cannot read the audit key"),
    ],
)
def test_a_bad_key_is_refused_with_where_it_came_from(env, message):
    with pytest.raises(signing.AuditKeyError, match=message):
        signing.key_from_env(env)


def test_no_key_is_refused_unless_insecure():
    with pytest.raises(signing.AuditKeyError, match="--insecure-no-key"):
        signing.require_key(None, insecure=False)
    signing.require_key(None, insecure=True)
    assert signing.insecure_from_env({signing.INSECURE_ENV: "1"})


def test_a_signed_record_parses_after_the_wire_round_trip():
    import orjson
    from audit_fixtures import make_adapter, make_record

    signed = sign_record(make_record(1, adapter=make_adapter(), n=2), KEY, "pool-a")
    record = parse_record(orjson.dumps(signed), key=KEY, pool="pool-a")
    assert record.request_id == "req-1" and len(record.outputs) == 2


@pytest.mark.parametrize(
    "tamper, reason",
    [
        (lambda r: r.pop("sig"), "unsigned record"),
        (lambda r: r["outputs"][0].update(text="forged"), "bad signature"),
        (lambda r: r.update(sig=r["sig"][:-1] + "0"), "bad signature"),
        (lambda r: r.update(sig=42), "bad signature"),
    ],
)
def test_tampered_or_unsigned_records_are_refused(tamper, reason):
    from audit_fixtures import make_record

    signed = sign_record(make_record(1), KEY, "pool-a")
    tamper(signed)
    with pytest.raises(RecordError, match=reason):
        check_signature(signed, KEY, "pool-a")


def test_another_key_or_another_pool_does_not_verify():
    from audit_fixtures import make_record

    signed = sign_record(make_record(1), KEY, "pool-a")
    with pytest.raises(RecordError, match="bad signature"):
        check_signature(copy.deepcopy(signed), b"j" * 40, "pool-a")
    with pytest.raises(RecordError, match="for pool 'pool-b'"):
        check_signature(copy.deepcopy(signed), KEY, "pool-b")


def test_the_worker_command_refuses_without_a_key_before_loading_anything(monkeypatch, tmp_path):
    from click.testing import CliRunner

    from lorapool.cli.queue import worker

    monkeypatch.delenv(signing.KEY_ENV)
    args = ["--model", str(tmp_path / "no-model"), "--redis-url", "redis://127.0.0.1:1/0"]
    result = CliRunner().invoke(worker, args)
    assert result.exit_code == 2 and "no audit key" in result.output
    monkeypatch.setenv(signing.INSECURE_ENV, "1")  # past the key check, then the model fails
    result = CliRunner().invoke(worker, args)
    assert result.exit_code != 0 and "no audit key" not in result.output
