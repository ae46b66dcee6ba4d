"""Alembic environment for the audit tables.

Run by :func:`lorapool.audit_db.database.migrate`, which passes an open
connection in ``config.attributes["connection"]``. Plain ``alembic`` use with
``sqlalchemy.url`` set in the config also works. SQLite uses batch mode.
"""

from alembic import context
from sqlalchemy import create_engine

from lorapool.audit_db.database import VERSION_TABLE
from lorapool.audit_db.schema import metadata


def _run(connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=metadata,
        version_table=VERSION_TABLE,
        render_as_batch=connection.dialect.name == "sqlite",
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations() -> None:
    connection = context.config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    engine = create_engine(context.config.get_main_option("sqlalchemy.url"))
    with engine.begin() as conn:
        _run(conn)


if context.is_offline_mode():
    raise SystemExit("offline (--sql) migrations are not supported")
run_migrations()
