"""``lorapool demo`` gives its workers and writer an audit key when none is set."""

import os

from rich.console import Console

from lorapool import signing
from lorapool.cli.demo_pipeline import ensure_audit_key


def test_the_demo_makes_a_key_in_its_cache_dir_once(tmp_path, monkeypatch):
    monkeypatch.setenv("LORAPOOL_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(signing.KEY_ENV)
    monkeypatch.setenv(signing.KEY_FILE_ENV, "")  # unset, and restored after the test
    ensure_audit_key(Console(quiet=True))
    path = tmp_path / "audit.key"
    assert os.environ[signing.KEY_FILE_ENV] == str(path)
    assert (path.stat().st_mode & 0o777) == 0o600
    key = signing.key_from_env()
    ensure_audit_key(Console(quiet=True))
    assert signing.key_from_env() == key  # the same key on the next run


def test_the_demo_keeps_a_key_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("LORAPOOL_CACHE_DIR", str(tmp_path))
    ensure_audit_key(Console(quiet=True))
    assert not (tmp_path / "audit.key").exists()
    assert signing.KEY_FILE_ENV not in os.environ
