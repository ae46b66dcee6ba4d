"""What makes an audit table append-only in the database itself: triggers that
refuse UPDATE and DELETE (and, on PostgreSQL, TRUNCATE). The migrations create them."""

REJECT_FUNCTION = """
CREATE FUNCTION audit_reject_change() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'lorapool audit: % on % is not allowed, the table is append-only',
        TG_OP, TG_TABLE_NAME;
END
$$
"""


def append_only_statements(dialect: str, table: str) -> list[str]:
    """The statements that create ``table``'s triggers (PostgreSQL's call
    ``audit_reject_change()``, made by :data:`REJECT_FUNCTION`; any other
    dialect gets SQLite's)."""
    if dialect == "postgresql":
        return [
            f"CREATE TRIGGER {table}_append_only BEFORE UPDATE OR DELETE ON {table} "
            "FOR EACH ROW EXECUTE FUNCTION audit_reject_change()",
            f"CREATE TRIGGER {table}_no_truncate BEFORE TRUNCATE ON {table} "
            "FOR EACH STATEMENT EXECUTE FUNCTION audit_reject_change()",
        ]
    return [
        f"CREATE TRIGGER {table}_no_{verb.lower()} BEFORE {verb} ON {table} "
        f"BEGIN SELECT RAISE(ABORT, 'lorapool audit: {verb} on {table} is "
        "not allowed, the table is append-only'); END"
        for verb in ("UPDATE", "DELETE")
    ]
