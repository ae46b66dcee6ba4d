"""What the ``lorapool audit`` commands share: the database options, the audit key,
times and output formats."""

from __future__ import annotations

import time

import click

from lorapool.times import epoch_seconds

_AGES = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_time(value: str | None) -> float | None:
    """Epoch seconds from an epoch number, ISO 8601 or an age ("24h" = a day ago)."""
    if value is None:
        return None
    value = value.strip()
    if value[-1:] in _AGES and value[:-1].replace(".", "", 1).isdigit():
        return time.time() - float(value[:-1]) * _AGES[value[-1]]
    try:
        return epoch_seconds(value)
    except ValueError:
        raise click.BadParameter(f"{value!r} is not epoch seconds, ISO 8601 or an age") from None


def engine_of(ctx: click.Context):
    """The command's engine on the audit database (one per invocation)."""
    from lorapool.audit_db import DatabaseConfig, create_audit_engine

    if ctx.obj.get("engine") is None:
        url, schema = ctx.obj["db_url"], ctx.obj["schema"]
        ctx.obj["engine"] = create_audit_engine(DatabaseConfig(url=url, schema=schema))
    return ctx.obj["engine"]


def db_options(fn):
    fn = click.option(
        "--schema",
        envvar="LORAPOOL_DB_SCHEMA",
        default=None,
        help="PostgreSQL schema holding the audit tables.",
    )(fn)
    return click.option(
        "--db-url",
        envvar="LORAPOOL_DB_URL",
        default=None,
        help="SQLAlchemy URL [default: SQLite file in the cache dir].",
    )(fn)


def insecure_option(fn):
    return click.option(
        "--insecure-no-key",
        "insecure",
        is_flag=True,
        envvar="LORAPOOL_AUDIT_INSECURE",
        help="Run without the audit key (nothing is authenticated).",
    )(fn)


def audit_key(insecure: bool) -> bytes | None:
    """The audit key from the environment, or a usage error saying how to give one."""
    from lorapool import signing

    try:
        key = signing.key_from_env()
        signing.require_key(key, insecure)
    except signing.AuditKeyError as exc:
        raise click.UsageError(str(exc)) from None
    return key


def format_option(fn):
    return click.option(
        "--format",
        "fmt",
        type=click.Choice(["table", "json", "csv"]),
        default="table",
        show_default=True,
    )(fn)


def parse_age(value: str | None, name: str) -> float | None:
    """Seconds from an age such as ``90s``, ``15m``, ``36h``, ``7d`` (or plain seconds)."""
    if value is None:
        return None
    value = value.strip()
    unit = _AGES.get(value[-1:])
    number = value[:-1] if unit else value
    try:
        seconds = float(number) * (unit or 1)
    except ValueError:
        raise click.BadParameter(f"{value!r} is not an age such as 36h", param_hint=name) from None
    if not seconds > 0:
        raise click.BadParameter(f"{value!r}: an age is positive", param_hint=name)
    return seconds
