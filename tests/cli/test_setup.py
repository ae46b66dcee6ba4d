"""Set-up as a new operator meets it: the audit key file, what --help says, one name for
a listen address, and one line (no traceback) for a deployment's mistake."""

import os
import stat
import subprocess
import sys

import click
import pytest
import redis
from click.testing import CliRunner

from lorapool.cli.main import COMMANDS, cli, setup_error


def test_keygen_writes_a_file_only_its_owner_reads(tmp_path):
    target = tmp_path / "audit.key"
    old = os.umask(0)  # even a permissive umask gives 0600
    try:
        made = CliRunner().invoke(cli, ["audit", "keygen", "-o", str(target)])
    finally:
        os.umask(old)
    assert made.exit_code == 0, made.output
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    key = target.read_text().strip()
    assert len(key) == 64 and key not in made.stdout  # never printed when written
    again = CliRunner().invoke(cli, ["audit", "keygen", "-o", str(target)])
    assert again.exit_code == 1 and "exists" in again.output
    assert target.read_text().strip() == key


def test_the_key_file_is_ignored_by_git(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for name in ("audit.key", "deploy/audit.key", ".env"):
        ignored = subprocess.run(["git", "check-ignore", "-q", name], cwd=root)
        assert ignored.returncode == 0, f"{name} is not git-ignored"


def _all_commands():
    for name in sorted(COMMANDS):
        command = cli.get_command(click.Context(cli), name)
        yield [name], command
        for sub, child in getattr(command, "commands", {}).items():
            yield [name, sub], child


@pytest.mark.parametrize("path", [p for p, _ in _all_commands()], ids=" ".join)
def test_every_help_names_the_environment_variables_it_reads(path):
    command = dict((tuple(p), c) for p, c in _all_commands())[tuple(path)]
    result = CliRunner().invoke(cli, [*path, "--help"], terminal_width=200)
    assert result.exit_code == 0, result.output
    for param in command.params:
        if isinstance(param, click.Option) and param.envvar and not param.hidden:
            names = [param.envvar] if isinstance(param.envvar, str) else param.envvar
            assert all(f"{n}" in result.output for n in names), (path, param.name)
            assert "env var:" in result.output


@pytest.mark.parametrize(
    ("path", "flag", "old"),
    [
        (["serve"], "--host", None),
        (["dashboard"], "--host", None),
        (["exporter"], "--host", "--addr"),
        (["worker"], "--metrics-host", "--metrics-addr"),
    ],
)
def test_one_name_for_a_listen_address(path, flag, old):
    shown = CliRunner().invoke(cli, [*path, "--help"], terminal_width=200).output
    assert flag in shown and "127.0.0.1" in shown
    for other in ("--addr", "--metrics-addr"):
        assert f"{other} " not in shown  # old names are hidden
    if old is not None:  # still accepted: what the former name says, wins over the default
        command = cli.get_command(click.Context(cli), path[0])
        required = ["--redis-url", "redis://x", "--model", "m"] if path == ["worker"] else []
        ctx = command.make_context(path[0], [old, "0.0.0.0", *required])
        assert ctx.params[flag.lstrip("-").replace("-", "_")] == "0.0.0.0"
        ctx = command.make_context(path[0], [old, "0.0.0.0", flag, "10.0.0.1", *required])
        assert ctx.params[flag.lstrip("-").replace("-", "_")] == "10.0.0.1"


def test_the_exporter_takes_redis_url_from_the_environment():
    shown = CliRunner().invoke(cli, ["exporter", "--help"], terminal_width=200).output
    assert "[required]" not in shown and "REDIS_URL" in shown
    missing = CliRunner().invoke(cli, ["exporter"], env={"REDIS_URL": ""})
    assert missing.exit_code == 2 and "REDIS_URL" in missing.output


NOPERM = "this user has no permissions to run the 'hget' command"
IN_SCRIPT = (
    "The user executing the script can't run this command or subcommand script: 1f, on @u:1."
)
WRONGPASS = "invalid username-password pair or user is disabled."


@pytest.mark.parametrize(
    ("error", "said"),
    [
        (redis.exceptions.NoPermissionError(NOPERM), "'hget'"),
        (redis.ResponseError(IN_SCRIPT), "can't run this command"),
        (redis.exceptions.AuthenticationError(WRONGPASS), "login"),
    ],
)
def test_a_deployment_error_is_one_line(error, said):
    message = setup_error(error)
    assert message is not None and said in message and "\n" not in message


def test_other_errors_stay_errors():
    assert setup_error(redis.ResponseError("WRONGTYPE Operation against a key")) is None
    assert setup_error(ValueError("x")) is None


def test_the_wrong_role_gets_one_line_from_the_command(tmp_path):
    """A real command, a real refusal: `keys list` as a user without the keys' rights."""
    from redis_server import RedisServer

    server = RedisServer(tmp_path / "redis").start()
    try:
        server.client().execute_command(
            "ACL", "SETUSER", "narrow", "on", ">pw", "~lorapool:requests", "-@all", "+ping", "+xadd"
        )
        url = f"redis://narrow:pw@127.0.0.1:{server.port}/0"
        cmd = [sys.executable, "-c", "from lorapool.cli.main import main; main()", "keys", "list"]
        done = subprocess.run(
            cmd, env={**os.environ, "REDIS_URL": url}, capture_output=True, text=True, cwd=tmp_path
        )
    finally:
        server.stop()
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert "NOPERM" in line and "docs/redis-acl.md" in line


def test_keys_list_has_a_header_and_shows_the_rate_limits(redis_url, conn):
    import uuid

    prefix = f"test-keys-{uuid.uuid4().hex[:8]}"
    where = ["--redis-url", redis_url, "--prefix", prefix]
    try:
        made = CliRunner().invoke(
            cli, ["keys", "add", "acme", "--rpm", "60", "--tpm", "5000", *where]
        )
        assert made.exit_code == 0, made.output
        listed = CliRunner().invoke(cli, ["keys", "list", *where]).output.splitlines()
        assert listed[0].split() == ["id", "tenant", "role", "rpm", "tpm", "adapters"]
        assert listed[1].split()[1:5] == ["acme", "submit", "60", "5000"]
    finally:
        for key in conn.scan_iter(f"{prefix}:*"):
            conn.delete(key)
