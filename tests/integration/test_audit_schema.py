"""`--migrate` into a PostgreSQL schema that does not exist yet: created when the role may,
else one clear line at once (it looped forever on "no schema has been selected to
create in", seven alembic lines a try). PostgreSQL only: SQLite has no schemas."""

import os
import subprocess
import sys
import time
import uuid

import pytest
from sqlalchemy import create_engine, text

from lorapool.audit_db import DatabaseConfig, create_audit_engine
from lorapool.audit_db.database import current_revision, migrate

pytestmark = pytest.mark.integration


@pytest.fixture
def pg():
    url = os.environ.get("LORAPOOL_TEST_PG_URL")
    if not url or not url.startswith("postgresql"):
        pytest.skip("no LORAPOOL_TEST_PG_URL (PostgreSQL): SQLite has no schemas")
    admin = create_engine(url, isolation_level="AUTOCOMMIT")
    made = {
        "schema": f"lp_schema_{uuid.uuid4().hex[:10]}",
        "role": f"lp_role_{uuid.uuid4().hex[:10]}",
    }
    yield url, admin, made
    with admin.connect() as conn:
        conn.execute(text(f"DROP SCHEMA IF EXISTS {made['schema']} CASCADE"))
        conn.execute(text(f"DROP ROLE IF EXISTS {made['role']}"))
    admin.dispose()


def test_migrate_creates_the_schema_it_is_told_to_use(pg):
    url, _, made = pg
    engine = create_audit_engine(DatabaseConfig(url=url, schema=made["schema"]))
    try:
        revision = migrate(engine)
        assert revision is not None and current_revision(engine) == revision
        with engine.connect() as conn:
            assert conn.execute(text("SELECT current_schema()")).scalar() == made["schema"]
            assert conn.execute(text("SELECT count(*) FROM completions")).scalar() == 0
    finally:
        engine.dispose()


def test_a_role_that_may_not_create_it_fails_once_with_one_line(pg, redis_url, conn, tmp_path):
    url, admin, made = pg
    with admin.connect() as sql:
        sql.execute(text(f"CREATE ROLE {made['role']} LOGIN"))
    role_url = url.replace("://postgres@", f"://{made['role']}@")
    cmd = [sys.executable, "-c", "from lorapool.cli.main import main; main()", "audit-writer",
           "--redis-url", redis_url, "--prefix", made["role"], "--db-url", role_url,
           "--schema", made["schema"], "--migrate", "--burst"]  # fmt: skip
    started = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    for key in conn.scan_iter(f"{made['role']}:*"):
        conn.delete(key)
    assert time.monotonic() - started < 30  # no retry loop
    assert done.returncode == 1, done.stderr
    error = [line for line in done.stderr.splitlines() if line.startswith("Error:")]
    assert len(error) == 1 and made["schema"] in error[0] and "may not create it" in error[0]
    assert "Traceback" not in done.stderr
