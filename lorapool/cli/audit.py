"""``lorapool audit ...``: migrate, verify, head, queries, conflicts, roles, keygen
(``lorapool audit-writer`` is in ``audit_writer.py``).

The audit key is ``$LORAPOOL_AUDIT_KEY`` or the file ``$LORAPOOL_AUDIT_KEY_FILE``
(see ``lorapool.signing``); verify and the writer need it. The database is
``--db-url`` / ``$LORAPOOL_DB_URL``, else the SQLite file
``<cache dir>/audit.sqlite``; ``--schema`` / ``$LORAPOOL_DB_SCHEMA`` picks a
PostgreSQL schema. Times (``--since``/``--until``) are epoch seconds, ISO 8601
(UTC when no zone is given) or an age such as ``90s``, ``15m``, ``24h``, ``7d``.
"""

from __future__ import annotations

import sys
import time

import click
from rich.console import Console

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


def _engine(ctx: click.Context):
    from lorapool.audit_db import DatabaseConfig, create_audit_engine

    url, schema = ctx.obj["db_url"], ctx.obj["schema"]
    return create_audit_engine(DatabaseConfig(url=url, schema=schema))


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


def _format_option(fn):
    return click.option(
        "--format",
        "fmt",
        type=click.Choice(["table", "json", "csv"]),
        default="table",
        show_default=True,
    )(fn)


@click.group()
@db_options
@click.pass_context
def audit(ctx: click.Context, db_url: str | None, schema: str | None):
    """The audit trail: migrate, verify and query it."""
    ctx.ensure_object(dict)
    ctx.obj.update(db_url=db_url, schema=schema)


@audit.command()
@click.option("--revision", default="head", show_default=True)
@click.pass_context
def migrate(ctx: click.Context, revision: str):
    """Create or upgrade the audit tables."""
    from lorapool.audit_db import migrate as run_migrations

    engine = _engine(ctx)
    now = run_migrations(engine, revision)
    click.echo(f"{engine.url.render_as_string(hide_password=True)}: at revision {now}")


def _verified(ctx: click.Context, insecure: bool, head_file=None):
    from lorapool.audit_db.verify import Head, HeadError, verify_chain

    head = None
    if head_file is not None:
        try:
            head = Head.from_json(head_file.read())
        except HeadError as exc:
            raise click.BadParameter(str(exc), param_hint="--head") from None
    report = verify_chain(_engine(ctx), key=audit_key(insecure), head=head)
    if not report.ok:
        click.echo(f"FAILED: {report.describe_failure()}", err=True)
        sys.exit(1)
    return report


@audit.command()
@click.option(
    "--head",
    "head_file",
    type=click.File("rb"),
    help="A head exported earlier (`audit head`): the chain must still reach it.",
)
@insecure_option
@click.pass_context
def verify(ctx: click.Context, head_file, insecure: bool):
    """Walk the hash chain; exit 1 and name the first row that does not match.

    With --head, also fail when rows were cut from the tail or the chain was
    rewritten since that head was exported.
    """
    report = _verified(ctx, insecure, head_file)
    click.echo(
        f"OK: {report.num_rows} rows, {report.num_adapters} adapters; "
        f"head seq={report.head_seq} hash={report.head_hash}"
    )


@audit.command()
@click.option("--output", "-o", type=click.File("wb"), default="-", help="Where to write it.")
@insecure_option
@click.pass_context
def head(ctx: click.Context, output, insecure: bool):
    """Verify the chain, then export its head (JSON) to keep outside the database.

    `audit verify --head FILE` later proves that no row up to it was cut or rewritten.
    """
    report = _verified(ctx, insecure)
    output.write(report.head().to_json() + b"\n")


@audit.command()
@click.option("--pool", help="Only this pool (Redis prefix).")
@_format_option
@click.pass_context
def conflicts(ctx: click.Context, pool: str | None, fmt: str):
    """Records refused because they contradict the stored row for their key; exit 1 if any."""
    from lorapool.audit_db.queries import list_conflicts
    from lorapool.cli import audit_format as out

    rows = list_conflicts(_engine(ctx), pool=pool)
    if fmt == "table":
        Console().print(out.conflicts_table(rows))
    else:
        _emit_rows(rows, fmt, "conflicts")
    if rows:
        sys.exit(1)


@audit.command()
@click.option("--owner", default="lorapool_owner", show_default=True, help="Owning role.")
@click.option("--writer", default="lorapool_writer", show_default=True, help="Writer role.")
@click.option("--reader", default="lorapool_reader", show_default=True, help="Reader role.")
@click.option("--owner-password", envvar="LORAPOOL_OWNER_PASSWORD", help="Set its password.")
@click.option("--writer-password", envvar="LORAPOOL_WRITER_PASSWORD", help="Set its password.")
@click.option("--reader-password", envvar="LORAPOOL_READER_PASSWORD", help="Set its password.")
@click.option(
    "--apply",
    "do_apply",
    is_flag=True,
    help="Run it (as --db-url's role, a superuser) and migrate as the owner; else print it.",
)
@click.pass_context
def roles(ctx: click.Context, do_apply: bool, **names):
    """PostgreSQL roles: an owner that migrates, a writer that can only insert and read.

    The schema is --schema (default lorapool_audit). Prints the SQL, or with
    --apply creates the roles and schema, migrates as the owner and grants the
    writer SELECT and INSERT only (no trigger or DDL rights). Re-run after an upgrade.
    """
    from lorapool.audit_db import DatabaseConfig
    from lorapool.audit_db.roles import Roles, apply_roles, role_sql

    try:
        spec = Roles(schema=ctx.obj["schema"] or "lorapool_audit", **names)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None
    if not do_apply:
        for statement in role_sql(spec):
            click.echo(statement if statement.startswith("--") else statement + ";")
        return
    revision = apply_roles(DatabaseConfig(url=ctx.obj["db_url"]), spec)
    click.echo(
        f"schema {spec.schema} at revision {revision}: owner {spec.owner}, "
        f"writer {spec.writer} (SELECT, INSERT), reader {spec.reader} (SELECT)"
    )


@audit.command()
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False, writable=True),
    help="write it to this new file, readable by its owner only (mode 0600), and "
    "refuse to overwrite one; else print it",
)
def keygen(output: str | None):
    """Make a fresh audit key: `lorapool audit keygen -o audit.key`, then point
    LORAPOOL_AUDIT_KEY_FILE at the file."""
    import os

    from lorapool import signing

    key = signing.new_key()
    if output is None:
        click.echo(key)
        return
    try:  # created 0600 from the start: never a moment when others may read it
        fd = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise click.ClickException(f"{output} exists: not overwriting an audit key") from None
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    click.echo(f"audit key written to {output} (mode 0600)", err=True)


def _emit_rows(rows: list[dict], fmt: str, title: str) -> None:
    from lorapool.cli import audit_format as out

    if fmt == "json":
        click.echo(out.to_json(rows))
    elif fmt == "csv":
        click.echo(out.to_csv(rows), nl=False)
    else:
        Console().print(out.rows_table(rows, title=title))


@audit.command("request")
@click.argument("request_id")
@click.option("--pool", help="Only this pool (Redis prefix) [default: every pool].")
@_format_option
@click.pass_context
def request_cmd(ctx: click.Context, request_id: str, pool: str | None, fmt: str):
    """Every audit row of one request."""
    from lorapool.audit_db import get_request
    from lorapool.cli import audit_format as out

    rows = get_request(_engine(ctx), request_id, pool=pool)
    if not rows:
        raise click.ClickException(f"no audit rows for request {request_id!r}")
    if fmt != "table":
        _emit_rows(rows, fmt, request_id)
        return
    for row in rows:
        Console().print(out.record_table(row))


@audit.command()
@click.option("--pool", help="Pool (Redis prefix).")
@click.option("--adapter", "adapter_name", help="Adapter name.")
@click.option("--adapter-id", type=int, help="Adapter int id.")
@click.option("--sha256", "adapter_sha256", help="Adapter weights hash (or a prefix).")
@click.option("--base-model-only", is_flag=True, help="Only requests without an adapter.")
@click.option("--since", help="From this time (inclusive).")
@click.option("--until", help="Before this time.")
@click.option("--finish-reason", type=click.Choice(["stop", "length", "abort", "error"]))
@click.option("--tenant")
@click.option("--text", help="Output text contains this (case-sensitive).")
@click.option("--limit", type=int, default=100, show_default=True)
@_format_option
@click.pass_context
def search(ctx: click.Context, fmt: str, since: str | None, until: str | None, **filters):
    """Audit rows matching every given filter."""
    from lorapool.audit_db import SearchFilter
    from lorapool.audit_db import search as run_search

    flt = SearchFilter(since=parse_time(since), until=parse_time(until), **filters)
    _emit_rows(run_search(_engine(ctx), flt), fmt, "audit rows")


@audit.command()
@click.option(
    "--by",
    type=click.Choice(["adapter", "adapter_version", "tenant"]),
    default="adapter",
    show_default=True,
)
@click.option("--since", help="From this time (inclusive).")
@click.option("--until", help="Before this time.")
@_format_option
@click.pass_context
def usage(ctx: click.Context, by: str, since: str | None, until: str | None, fmt: str):
    """Requests, tokens, errors and latency per adapter or tenant."""
    from lorapool.audit_db import usage as run_usage
    from lorapool.cli import audit_format as out

    rows = run_usage(_engine(ctx), by=by, since=parse_time(since), until=parse_time(until))
    if fmt == "json":
        click.echo(out.to_json(rows))
    elif fmt == "csv":
        click.echo(out.to_csv(rows), nl=False)
    else:
        Console().print(out.usage_table(rows, title=f"usage by {by}"))
