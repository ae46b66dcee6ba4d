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

import click

from lorapool.cli.audit_common import (
    audit_key,
    db_options,
    engine_of,
    format_option,
    insecure_option,
    parse_time,
)


def _console():
    from rich.console import Console  # rich only for tables: JSON and CSV start faster

    return Console()


@click.group()
@db_options
@click.pass_context
def audit(ctx: click.Context, db_url: str | None, schema: str | None):
    """The audit trail: migrate, verify and query it."""
    ctx.ensure_object(dict)
    ctx.obj.update(db_url=db_url, schema=schema, engine=None)


@audit.command()
@click.option("--revision", default="head", show_default=True)
@click.pass_context
def migrate(ctx: click.Context, revision: str):
    """Create or upgrade the audit tables."""
    from lorapool.audit_db import migrate as run_migrations

    engine = engine_of(ctx)
    now = run_migrations(engine, revision)
    click.echo(f"{engine.url.render_as_string(hide_password=True)}: at revision {now}")


@audit.command()
@click.option("--pool", help="Only this pool (Redis prefix).")
@format_option
@click.pass_context
def conflicts(ctx: click.Context, pool: str | None, fmt: str):
    """Records refused because they contradict the stored row for their key; exit 1 if any."""
    from lorapool.audit_db.queries import list_conflicts
    from lorapool.cli import audit_format as out

    rows = list_conflicts(engine_of(ctx), pool=pool)
    if fmt == "table":
        _console().print(out.conflicts_table(rows))
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


def _emit_rows(rows, fmt: str, title: str, output=None) -> None:
    """Rows (any iterable: streamed as they come, unless a table) in ``fmt``."""
    from lorapool.audit_export import encode
    from lorapool.cli import audit_format as out

    if fmt == "table":
        _console().print(out.rows_table(list(rows), title=title))
        return
    sink = output or click.get_binary_stream("stdout")
    for chunk in encode(rows, fmt):
        sink.write(chunk)
    sink.flush()


@audit.command("request")
@click.argument("request_id")
@click.option("--pool", help="Only this pool (Redis prefix) [default: every pool].")
@format_option
@click.pass_context
def request_cmd(ctx: click.Context, request_id: str, pool: str | None, fmt: str):
    """Every audit row of one request."""
    from lorapool.audit_db import get_request
    from lorapool.cli import audit_format as out

    rows = get_request(engine_of(ctx), request_id, pool=pool)
    if not rows:
        raise click.ClickException(f"no audit rows for request {request_id!r}")
    if fmt != "table":
        _emit_rows(rows, fmt, request_id)
        return
    for row in rows:
        _console().print(out.record_table(row))


def _filter_options(fn):
    for option in reversed(
        [
            click.option("--pool", help="Pool (Redis prefix)."),
            click.option("--adapter", "adapter_name", help="Adapter name."),
            click.option("--adapter-id", type=int, help="Adapter int id."),
            click.option("--sha256", "adapter_sha256", help="Adapter weights hash (or a prefix)."),
            click.option(
                "--base-model-only", is_flag=True, help="Only requests without an adapter."
            ),
            click.option("--since", help="From this time (inclusive)."),
            click.option("--until", help="Before this time."),
            click.option(
                "--finish-reason", type=click.Choice(["stop", "length", "abort", "error"])
            ),
            click.option("--tenant"),
            click.option("--text", help="Output text contains this (case-sensitive)."),
        ]
    ):
        fn = option(fn)
    return fn


def _search_filter(ctx, since, until, limit, filters):
    """The filter, checked: a text search no index can serve needs a small window."""
    from lorapool.audit_db import SearchFilter
    from lorapool.audit_db.queries import TextSearchRefused, check_filter

    flt = SearchFilter(since=parse_time(since), until=parse_time(until), limit=limit, **filters)
    try:
        check_filter(engine_of(ctx), flt)
    except TextSearchRefused as exc:
        raise click.UsageError(str(exc)) from None
    return flt


@audit.command()
@_filter_options
@click.option("--limit", type=int, default=100, show_default=True)
@format_option
@click.pass_context
def search(ctx: click.Context, fmt: str, since: str | None, until: str | None, limit, **filters):
    """Audit rows matching every given filter (in arrival order)."""
    from lorapool.audit_db.queries import iter_search

    flt = _search_filter(ctx, since, until, limit, filters)
    _emit_rows(iter_search(engine_of(ctx), flt), fmt, "audit rows")


@audit.command()
@_filter_options
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["csv", "jsonl", "json"]),
    default="jsonl",
    show_default=True,
)
@click.option("--output", "-o", type=click.File("wb"), default="-", help="Where to write it.")
@click.pass_context
def export(ctx: click.Context, fmt: str, since, until, output, **filters):
    """Every audit row matching the filters, streamed from a server-side cursor: memory
    stays bounded at any size. CSV cells a spreadsheet would run are neutralised."""
    from lorapool.audit_db.queries import iter_search

    flt = _search_filter(ctx, since, until, None, filters)
    _emit_rows(iter_search(engine_of(ctx), flt), fmt, "audit rows", output)


@audit.command()
@click.option(
    "--by",
    type=click.Choice(["adapter", "adapter_version", "tenant"]),
    default="adapter",
    show_default=True,
)
@click.option("--since", help="From this time (inclusive).")
@click.option("--until", help="Before this time.")
@click.option(
    "--exact/--rollup",
    default=None,
    help="Read every row of the period, or whole days from the writer's rollup "
    "(percentiles within 0.5%) [default: exact up to 10,000 requests].",
)
@click.option(
    "--rebuild-rollup", is_flag=True, help="First recompute the rollup from the rows (the owner's)."
)
@format_option
@click.pass_context
def usage(ctx, by: str, since: str | None, until: str | None, exact, rebuild_rollup, fmt: str):
    """Requests, tokens, errors and latency per adapter or tenant."""
    from lorapool.audit_db import usage as run_usage
    from lorapool.cli import audit_format as out

    if rebuild_rollup:
        from lorapool.audit_db.rollup import rebuild_all

        click.echo(f"rollup rebuilt: {rebuild_all(engine_of(ctx))} cells", err=True)
    period = {"since": parse_time(since), "until": parse_time(until)}
    rows = run_usage(engine_of(ctx), by=by, exact=exact, **period)
    if fmt == "json":
        click.echo(out.to_json(rows))
    elif fmt == "csv":
        click.echo(out.to_csv(rows), nl=False)
    else:
        _console().print(out.usage_table(rows, title=f"usage by {by}"))


def _register() -> None:
    from lorapool.cli.audit_verify import archive, checkpoint, head, verify, verify_archive

    for command in (verify, head, checkpoint, archive, verify_archive):
        audit.add_command(command)


_register()
__all__ = ["audit", "audit_key", "db_options", "insecure_option", "parse_time"]
