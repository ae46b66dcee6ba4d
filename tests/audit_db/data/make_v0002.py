"""Writes ``v0002.json``: the audit tables of a database written by the code at
migration revision 0002 (commit e6bbf4d), as stored (escaped text, JSON values),
so that the upgrade test loads exactly what that version wrote.

Run once, with that version checked out (kept for provenance)::

    LORAPOOL_AUDIT_KEY=lorapool-test-audit-key-0123456789abcdef \
        .venv/bin/python tests/audit_db/data/make_v0002.py
"""

import sys
import tempfile
from pathlib import Path

import orjson
from sqlalchemy import MetaData, select

sys.path.insert(0, str(Path(__file__).parents[2] / "support"))
from audit_fixtures import make_adapter, make_record  # noqa: E402

from lorapool import signing  # noqa: E402
from lorapool.audit_db import DatabaseConfig, create_audit_engine, migrate  # noqa: E402
from lorapool.audit_db.store import append, prepare  # noqa: E402
from lorapool.records.audit import record_from_dict  # noqa: E402


def records() -> list[dict]:
    adapters = [None, make_adapter("sql-lora", 1, 1), make_adapter("chat-lora", 2, 1)]
    made = []
    for i in range(24):
        record = make_record(
            i,
            adapter=adapters[i % 3],
            tenant=("acme", "globex", None)[i % 3],
            n=1 + (i % 4 == 0),
            text_for=lambda i, k: f"answer {i}.{k} \0 with NUL, \ufdd0 and ünïcode",
        )
        made.append(record)
    return made


def main() -> None:
    key = signing.key_from_env()
    assert key is not None, "set LORAPOOL_AUDIT_KEY to the tests' key"
    with tempfile.TemporaryDirectory() as tmp:
        engine = create_audit_engine(DatabaseConfig(url=f"sqlite:///{tmp}/a.sqlite"))
        assert migrate(engine) == "0002"
        for n, record in enumerate(records()):
            rows = prepare(record_from_dict(record), "lorapool", now=1_700_100_000.0 + n)
            append(engine, rows, key)
        clash = make_record(3, text_for=lambda i, k: "a different answer")
        append(engine, prepare(record_from_dict(clash), "lorapool", now=1_700_200_000.0), key)
        meta = MetaData()
        meta.reflect(engine)
        dump = {}
        with engine.connect() as conn:
            for name in ("adapters", "completions", "conflicts", "audit_meta"):
                table = meta.tables[name]
                rows = conn.execute(select(table).order_by(*table.primary_key)).mappings()
                dump[name] = [{str(k): v for k, v in r.items()} for r in rows]
        engine.dispose()
    out = Path(__file__).with_name("v0002.json")
    out.write_bytes(orjson.dumps(dump, option=orjson.OPT_INDENT_2) + b"\n")
    print(f"{out}: {', '.join(f'{k} {len(v)}' for k, v in dump.items())}")


if __name__ == "__main__":
    main()
