"""Connecting to the audit database, and migrating it.

SQLite (the default, a file) is opened in WAL mode with a busy timeout,
``synchronous=FULL`` (a commit the writer acks is on disk) and foreign keys on;
transactions start with an explicit ``BEGIN`` (``BEGIN IMMEDIATE`` for writes,
which serializes writers). PostgreSQL goes through psycopg 3; ``schema`` puts
the tables in that schema via ``search_path``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import orjson
from sqlalchemy import Connection, Engine, create_engine, event, make_url, text

from lorapool import settings

DEFAULT_SQLITE_NAME = "audit.sqlite"
VERSION_TABLE = "audit_alembic_version"
MIGRATIONS_DIR = Path(__file__).parent / "migrations"
# Advisory lock class for the chain; the object id is the hash of the schema.
_CHAIN_LOCK_CLASS = 0x1A0D17


def default_url() -> str:
    """``$LORAPOOL_DB_URL``, else the SQLite file ``<cache dir>/audit.sqlite``."""
    return settings.db_url() or f"sqlite:///{settings.cache_dir() / DEFAULT_SQLITE_NAME}"


@dataclass(frozen=True)
class DatabaseConfig:
    """Where the audit tables live.

    url: an SQLAlchemy URL (``sqlite:///file`` or ``postgresql+psycopg://...``);
    None means :func:`default_url`. schema: PostgreSQL schema to use (must
    exist); None means the server's default search_path.
    """

    url: str | None = None
    schema: str | None = None
    busy_timeout_ms: int = 30_000
    connect_timeout_s: int = 10
    echo: bool = False
    application_name: str | None = None  # PostgreSQL: who this is in pg_stat_activity

    @property
    def resolved_url(self) -> str:
        return self.url or default_url()


def _dumps(value) -> str:
    return orjson.dumps(value).decode()


def create_audit_engine(config: DatabaseConfig | None = None) -> Engine:
    """An Engine for the audit tables with this project's SQLite/PostgreSQL defaults."""
    config = config or DatabaseConfig()
    url = make_url(config.resolved_url)
    kwargs = {"echo": config.echo, "json_serializer": _dumps, "json_deserializer": orjson.loads}
    if url.get_backend_name() == "sqlite":
        engine = create_engine(url, **kwargs)
        _install_sqlite_events(engine, config.busy_timeout_ms)
        return engine
    connect_args = {"connect_timeout": config.connect_timeout_s}
    if config.application_name:
        connect_args["application_name"] = config.application_name
    if config.schema:
        connect_args["options"] = f"-csearch_path={config.schema}"
    return create_engine(url, pool_pre_ping=True, connect_args=connect_args, **kwargs)


def _install_sqlite_events(engine: Engine, busy_timeout_ms: int) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection, _record):
        # Let SQLAlchemy, not the sqlite3 module, decide when transactions begin.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute(f"PRAGMA busy_timeout = {int(busy_timeout_ms)}")
        cursor.execute("PRAGMA journal_mode = WAL")
        cursor.execute("PRAGMA synchronous = FULL")
        cursor.execute("PRAGMA foreign_keys = ON")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection):
        write = conn.get_execution_options().get("audit_write", False)
        conn.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")


_LOCK = text(
    "SELECT pg_advisory_xact_lock(:cls, hashtext(current_schema())), set_config('jit', 'off', true)"
)
# An engine's execution option (``with_stall_timeout``): milliseconds a write transaction
# may wait for the chain lock, run one statement, or sit idle before PostgreSQL ends it
STALL_OPTION = "audit_stall_timeout_ms"
_STALL = text(
    "SELECT set_config('lock_timeout', :ms, true), set_config('statement_timeout', :ms, true),"
    " set_config('idle_in_transaction_session_timeout', :ms, true)"
)


def with_stall_timeout(engine: Engine, seconds: float | None) -> Engine:
    """``engine`` whose write transactions (PostgreSQL) give up on the chain lock, a
    statement or an idle client after ``seconds`` (None: never, the server's settings).

    A writer that stops answering mid-batch (SIGSTOP, a VM frozen, a partition) holds
    the chain lock in an open transaction; with these the server rolls that batch back
    and frees the lock within ``seconds``, a writer waiting for it gives up and retries
    instead of queueing behind it forever, and the stopped one's batch is redone by
    whoever claims its entries (its rows stored once). Not for migrations, whose
    statements may rightly run long (``migrate`` drops the option)."""
    return engine.execution_options(
        **{STALL_OPTION: None if seconds is None else round(seconds * 1000)}
    )


@contextlib.contextmanager
def write_transaction(engine: Engine) -> Iterator[Connection]:
    """A transaction that holds the audit write lock until it commits.

    PostgreSQL: a transaction-scoped advisory lock per schema, and no JIT in the
    transaction (its statements are index look-ups; where a partition has no
    statistics yet, their estimated cost passes ``jit_above_cost`` and compiling
    took 400 ms a batch at 200,000 rows). SQLite: ``BEGIN IMMEDIATE`` takes the
    database's write lock up front.
    """
    with engine.execution_options(audit_write=True).begin() as conn:
        if conn.dialect.name == "postgresql":
            stall_ms = conn.get_execution_options().get(STALL_OPTION)
            if stall_ms:  # before the lock: its wait is bounded too
                conn.execute(_STALL, {"ms": str(stall_ms)})
            conn.execute(_LOCK, {"cls": _CHAIN_LOCK_CLASS})
        yield conn


def _alembic_config(connection: Connection):
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.attributes["connection"] = connection
    return config


def _ensure_sqlite_dir(engine: Engine) -> None:
    database = engine.url.database
    if engine.dialect.name == "sqlite" and database and database != ":memory:":
        Path(database).expanduser().parent.mkdir(parents=True, exist_ok=True)


class SchemaMissing(RuntimeError):
    """The PostgreSQL schema the engine is told to use does not exist and cannot be
    created by its role: retrying will not help."""


def migrate(engine: Engine, revision: str = "head") -> str | None:
    """Upgrade the audit tables to ``revision``; returns the revision now current.

    Runs under the audit write lock, so concurrent callers are safe. Creates the
    SQLite file's folder, and the PostgreSQL schema the engine uses, when missing
    (SchemaMissing when its role may not create it).
    """
    from alembic import command

    _ensure_sqlite_dir(engine)
    _ensure_schema(engine)
    with write_transaction(with_stall_timeout(engine, None)) as conn:  # may run long
        command.upgrade(_alembic_config(conn), revision)
    return current_revision(engine)


def _ensure_schema(engine: Engine) -> None:
    """``CREATE SCHEMA`` the first schema of the connection's search_path (the engine's
    ``schema``) when it does not exist."""
    if engine.dialect.name != "postgresql":
        return
    from sqlalchemy.exc import ProgrammingError

    with engine.connect() as conn:
        if conn.execute(text("SELECT current_schema()")).scalar() is not None:
            return
        first = conn.execute(text("SHOW search_path")).scalar().split(",")[0].strip()
        name = first[1:-1].replace('""', '"') if first.startswith('"') else first
        if not name or name == "$user":
            return
        try:
            conn.execute(
                text(f"CREATE SCHEMA IF NOT EXISTS {conn.dialect.identifier_preparer.quote(name)}")
            )
            conn.commit()
        except ProgrammingError as exc:  # no CREATE on the database
            user = engine.url.username or "this role"
            raise SchemaMissing(
                f"schema {name!r} does not exist and {user} may not create it "
                f"({type(exc.orig).__name__}): create it, or run `lorapool audit roles --apply` "
                "as the database owner"
            ) from None


def current_revision(engine: Engine) -> str | None:
    """The migration revision the database is at (None: not migrated)."""
    from alembic.runtime.migration import MigrationContext

    with engine.connect() as conn:
        context = MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE})
        return context.get_current_revision()


def head_revision() -> str:
    """The newest migration revision shipped with this package."""
    from alembic.script import ScriptDirectory

    return ScriptDirectory(str(MIGRATIONS_DIR)).get_current_head()


def is_current(engine: Engine) -> bool:
    """True when the database is migrated to the newest revision."""
    return current_revision(engine) == head_revision()
