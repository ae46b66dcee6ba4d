"""PostgreSQL roles for the audit trail: an owner, a writer that can only add, a reader.

- ``owner`` owns the schema and the tables; migrations run as it. Only an
  owner (or a superuser) can disable or drop a trigger or drop a table, so no
  process that runs all the time should hold it.
- ``writer`` (the audit writer): ``SELECT`` on every audit table, ``INSERT`` on
  ``adapters``, ``completions``, ``conflicts``, ``audit_meta`` and ``checkpoints``,
  ``INSERT`` and ``UPDATE`` on ``usage_daily`` and ``usage_progress`` (the rollup
  it keeps),
  ``USAGE`` on their sequences and ``EXECUTE`` on ``audit_ensure_period`` (which
  makes a month's partition as the owner, and nothing else); no
  ``UPDATE``/``DELETE``/``TRUNCATE``, no trigger or DDL rights.
- ``reader`` (queries, ``audit verify``): ``SELECT`` only.

:func:`role_sql` is the SQL an administrator runs once (``lorapool audit roles``
prints it); :func:`apply_roles` runs it, then the migrations as the owner, then
the grants on the tables the migrations made. Every statement is idempotent,
so it is re-run after an upgrade that adds a table.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from sqlalchemy import Engine, event, text

from lorapool.audit_db.database import DatabaseConfig, create_audit_engine, migrate

WRITER_TABLES = ("adapters", "completions", "conflicts", "audit_meta", "checkpoints")
_NAME = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")


@dataclass(frozen=True)
class Roles:
    """Role and schema names (lower-case SQL identifiers) and optional passwords."""

    schema: str = "lorapool_audit"
    owner: str = "lorapool_owner"
    writer: str = "lorapool_writer"
    reader: str = "lorapool_reader"
    owner_password: str | None = None
    writer_password: str | None = None
    reader_password: str | None = None

    def __post_init__(self):
        for field in ("schema", "owner", "writer", "reader"):
            value = getattr(self, field)
            if not _NAME.match(value):
                raise ValueError(
                    f"{field}: {value!r} is not a plain lower-case SQL name ([a-z_][a-z0-9_]*)"
                )
        if len({self.owner, self.writer, self.reader}) != 3:
            raise ValueError("owner, writer and reader must be three different roles")


def _literal(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


def _create_role(name: str, password: str | None) -> list[str]:
    create = (
        f"DO $$ BEGIN IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '{name}') "
        f"THEN CREATE ROLE {name} LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE; END IF; END $$"
    )
    statements = [create]
    if password is not None:
        statements.append(f"ALTER ROLE {name} PASSWORD {_literal(password)}")
    return statements


def create_sql(roles: Roles) -> list[str]:
    """Roles and the schema (owned by the owner); run before the migrations."""
    statements = []
    for name, password in (
        (roles.owner, roles.owner_password),
        (roles.writer, roles.writer_password),
        (roles.reader, roles.reader_password),
    ):
        statements += _create_role(name, password)
    s, owner = roles.schema, roles.owner
    return statements + [
        f"CREATE SCHEMA IF NOT EXISTS {s} AUTHORIZATION {owner}",
        f"ALTER SCHEMA {s} OWNER TO {owner}",
        # the text index's operator class (a trusted extension, but the owner role
        # may not create extensions in the database); once per database
        "CREATE EXTENSION IF NOT EXISTS pg_trgm WITH SCHEMA public",
        f"REVOKE ALL ON SCHEMA {s} FROM PUBLIC",
        f"GRANT USAGE ON SCHEMA {s} TO {roles.writer}, {roles.reader}",
        f"ALTER DEFAULT PRIVILEGES FOR ROLE {owner} IN SCHEMA {s} "
        f"GRANT SELECT ON TABLES TO {roles.writer}, {roles.reader}",
    ]


def grant_sql(roles: Roles) -> list[str]:
    """Grants on the tables the migrations made; run after each migration."""
    s, writer = roles.schema, roles.writer
    tables = ", ".join(f"{s}.{t}" for t in WRITER_TABLES)
    return [
        f"GRANT SELECT ON ALL TABLES IN SCHEMA {s} TO {writer}, {roles.reader}",
        f"GRANT INSERT ON {tables} TO {writer}",
        # the rollup it keeps (derived data, not chained)
        f"GRANT INSERT, UPDATE ON {s}.usage_daily, {s}.usage_progress TO {writer}",
        f"GRANT USAGE ON ALL SEQUENCES IN SCHEMA {s} TO {writer}",
        # the one DDL it may ask for: this month's partition (made by the owner's function)
        f"GRANT EXECUTE ON FUNCTION {s}.audit_ensure_period(integer) TO {writer}",
    ]


def role_sql(roles: Roles) -> list[str]:
    """Everything, in order, with the migration step as a comment between."""
    return [
        *create_sql(roles),
        f"-- now migrate as {roles.owner}: lorapool audit migrate --schema {roles.schema}",
        *grant_sql(roles),
    ]


def _owner_engine(config: DatabaseConfig, owner: str) -> Engine:
    """An engine whose every connection acts as ``owner`` (SET ROLE on connect)."""
    engine = create_audit_engine(config)

    @event.listens_for(engine, "connect")
    def _set_role(dbapi_connection, _record):
        with dbapi_connection.cursor() as cursor:
            cursor.execute(f"SET ROLE {owner}")
        dbapi_connection.commit()

    return engine


def _run(engine: Engine, statements: list[str]) -> None:
    with engine.begin() as conn:
        for statement in statements:
            conn.execute(text(statement))


def apply_roles(config: DatabaseConfig, roles: Roles) -> str | None:
    """Create the roles and schema, migrate as the owner, grant; returns the revision.

    ``config`` connects as a role that can create roles and act as the owner
    (a superuser, or a CREATEROLE role that is a member of it); its schema is
    replaced by ``roles.schema``.
    """
    config = replace(config, schema=roles.schema)
    admin = create_audit_engine(config)
    if admin.dialect.name != "postgresql":
        raise ValueError("roles are a PostgreSQL feature; SQLite has none")
    owner = _owner_engine(config, roles.owner)
    try:
        _run(admin, create_sql(roles))
        revision = migrate(owner)
        _run(admin, grant_sql(roles))
    finally:
        owner.dispose()
        admin.dispose()
    return revision
