"""Compact token ids as packed bytes on PostgreSQL too.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-26

Revision 0003 kept a version 2 row's token ids as ``int4[]`` on PostgreSQL. Reading
one back cost ~80 µs a row in psycopg (448 ids), while the chain hashes the ids as
packed little-endian int32 anyway (chain.py): ``prompt_tokens`` and
``output_tokens`` become ``bytea`` holding exactly those bytes, as SQLite's BLOBs
already do. Each array is converted in SQL (every id's big-endian ``int4send``
bytes, reversed); the rows' hashes do not change.
"""

from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

TO_PACKED = """
CREATE FUNCTION audit_packed_ids(a int4[]) RETURNS bytea
LANGUAGE sql IMMUTABLE STRICT AS $$
    SELECT coalesce(
        string_agg(substring(b FROM 4 FOR 1) || substring(b FROM 3 FOR 1)
                   || substring(b FROM 2 FOR 1) || substring(b FROM 1 FOR 1), ''::bytea
                   ORDER BY o),
        ''::bytea)
    FROM unnest(a) WITH ORDINALITY AS t(x, o), LATERAL (SELECT int4send(x) AS b) AS s
$$
"""


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return  # SQLite's columns are BLOBs of these bytes already
    op.execute(TO_PACKED)
    for column in ("prompt_tokens", "output_tokens"):
        op.execute(
            f"ALTER TABLE completions ALTER COLUMN {column} TYPE bytea "
            f"USING audit_packed_ids({column})"
        )
    op.execute("DROP FUNCTION audit_packed_ids(int4[])")


def downgrade() -> None:
    raise RuntimeError("0006 cannot be undone in place")
