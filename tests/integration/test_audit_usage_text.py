"""Usage from the writer's rollup against the rows themselves, text search through
its index (or refused without a time window), and the query plans the indexes
give, on SQLite and PostgreSQL."""

import random
import statistics
import uuid

import pytest
from audit_fixtures import KEY, make_adapter, make_record
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import text

from lorapool.audit_db import SearchFilter, append_records, search
from lorapool.audit_db import text_search as ts
from lorapool.audit_db.queries import TextSearchRefused
from lorapool.audit_db.store import refresh_rollup
from lorapool.audit_db.usage import usage
from lorapool.records.audit import record_from_dict

pytest_plugins = ["audit_fixtures"]
pytestmark = pytest.mark.integration
DAY = 86_400.0
T0 = 1_767_225_600.0  # 2026-01-01T00:00:00Z


def _records(count: int, seed: int = 5) -> list[dict]:
    """Requests over six days, many adapters and tenants, latencies 10 ms - 20 s."""
    rng = random.Random(seed)
    adapters = [None] + [make_adapter(f"lora-{k}", k, 1 + k % 2) for k in range(1, 6)]
    made = []
    for i in range(count):
        reason = rng.choice(["stop", "stop", "length", "error"])
        made.append(
            make_record(
                i,
                adapter=rng.choice(adapters),
                tenant=rng.choice(["acme", "globex", "initech", None, "n\0l \ufdd0"]),
                n=rng.choice([1, 1, 2]),
                arrival=T0 + rng.uniform(0, 6 * DAY),
                latency=10 ** rng.uniform(-2, 1.3),
                finish_reason=reason,
                error="boom" if reason == "error" and i % 2 else None,
            )
        )
    return made


@pytest.fixture
def spread(audit_target):
    records = _records(600)
    for start in range(0, len(records), 100):  # six writer transactions
        chunk = records[start : start + 100]
        append_records(audit_target.engine, [record_from_dict(r) for r in chunk], key=KEY)
        if start == 200:  # the rollup covers the first half; usage reads the rest
            rows = sum(len(r["outputs"]) for r in records[:300])
            assert refresh_rollup(audit_target.engine) == rows
    return audit_target.engine


@pytest.mark.parametrize("by", ["adapter", "adapter_version", "tenant"])
@pytest.mark.parametrize(
    "period",
    [
        (None, None),
        (T0 + 0.4 * DAY, T0 + 4.7 * DAY),
        (T0 + 1.2 * DAY, T0 + 1.9 * DAY),
        (T0 + 2 * DAY, None),
    ],
)
def test_usage_from_the_rollup_matches_the_rows(spread, by, period):
    exact = {r.key: r for r in usage(spread, by, *period, exact=True)}
    rolled = {r.key: r for r in usage(spread, by, *period, exact=False)}
    assert sorted(rolled) == sorted(exact) and exact
    for key, want in exact.items():
        got = rolled[key]
        counts = ("requests", "prompt_tokens", "completion_tokens", "errors")
        assert [getattr(got, c) for c in counts] == [getattr(want, c) for c in counts], key
        assert want.latency_exact and not got.latency_exact
        for q in ("latency_p50", "latency_p95"):
            assert getattr(got, q) == pytest.approx(getattr(want, q), rel=0.006), (key, q)


def test_exact_usage_percentiles_match_statistics(spread):
    records = _records(600)
    latencies = [r["metrics"]["finished_time"] - r["metrics"]["arrival_time"] for r in records]
    [total] = [r for r in usage(spread, "adapter", exact=True) if r.key == "lora-1"] or [None]
    ones = [
        lat for r, lat in zip(records, latencies) if (r["adapter"] or {}).get("name") == "lora-1"
    ]
    cuts = statistics.quantiles(ones, n=100, method="inclusive")
    assert total.requests == len(ones)
    assert total.latency_p50 == pytest.approx(cuts[49]) and total.latency_p95 == pytest.approx(
        cuts[94]
    )


def _texts(engine):
    with engine.connect() as conn:
        return conn.execute(text("SELECT count(*) FROM completions")).scalar()


NEEDLE_ALPHABET = st.sampled_from(list("ab%_\\\x00\ufdd0\"'x "))


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    parts=st.lists(
        st.tuples(
            st.text(NEEDLE_ALPHABET, max_size=6),
            st.booleans(),
            st.text(NEEDLE_ALPHABET, max_size=6),
        ),
        min_size=1,
        max_size=6,
    ),
    needle=st.text(NEEDLE_ALPHABET, min_size=1, max_size=5),
)
def test_text_search_is_a_literal_case_sensitive_substring(audit_target, parts, needle):
    texts = [head + (needle if embed else "") + tail for head, embed, tail in parts]
    run = uuid.uuid4().hex[:8]
    records = []
    for i, body in enumerate(texts):
        record = make_record(i, text_for=lambda _i, _k, body=body: body, arrival=T0 + i)
        record["request_id"] = f"{run}-{i}"
        records.append(record)
    append_records(audit_target.engine, [record_from_dict(r) for r in records], key=KEY)
    window = {"since": T0 - 1, "until": T0 + DAY}  # short needles need one
    found = search(audit_target.engine, SearchFilter(text=needle, limit=None, **window))
    mine = sorted(r["request_id"] for r in found if r["request_id"].startswith(run))
    assert mine == sorted(f"{run}-{i}" for i, body in enumerate(texts) if needle in body)


def _drop_text_index(target):
    with target.engine.begin() as conn:
        if target.kind == "postgresql":
            conn.execute(text(f"DROP INDEX {ts.PG_INDEX}"))
        else:
            conn.execute(text(f"DROP TRIGGER {ts.SQLITE_FTS}_insert"))
            conn.execute(text(f"DROP TABLE {ts.SQLITE_FTS}"))
    ts._HAS_INDEX.pop(target.engine, None)


def test_text_search_without_an_index_needs_a_window(audit_target):
    records = [
        make_record(i, text_for=lambda i, k: f"needle {i}", arrival=T0 + i) for i in range(5)
    ]
    append_records(audit_target.engine, [record_from_dict(r) for r in records], key=KEY)
    assert len(search(audit_target.engine, SearchFilter(text="needle"))) == 5  # indexed
    with pytest.raises(TextSearchRefused, match="time window"):
        search(audit_target.engine, SearchFilter(text="ne"))  # too short for trigrams
    _drop_text_index(audit_target)
    with pytest.raises(TextSearchRefused, match="no text index here"):
        search(audit_target.engine, SearchFilter(text="needle"))
    with pytest.raises(TextSearchRefused):  # a window too wide is no window
        search(audit_target.engine, SearchFilter(text="needle", since=T0, until=T0 + 40 * DAY))
    found = search(audit_target.engine, SearchFilter(text="needle 3", since=T0, until=T0 + DAY))
    assert [r["request_id"] for r in found] == ["req-3"]


def _plan(target, sql: str) -> str:
    with target.engine.begin() as conn:
        conn.execute(text("SET LOCAL enable_seqscan = off"))
        return "\n".join(r[0] for r in conn.execute(text(f"EXPLAIN {sql}")))


def test_postgresql_indexes_and_plans(audit_target):
    if audit_target.kind != "postgresql":
        pytest.skip("PostgreSQL's indexes and plans")
    append_records(audit_target.engine, [record_from_dict(make_record(1))], key=KEY)
    with audit_target.engine.connect() as conn:
        found = conn.execute(
            text("SELECT indexdef FROM pg_indexes WHERE tablename = 'completions' "
                 "AND schemaname = current_schema()")
        ).scalars().all()  # fmt: skip
    defined = " | ".join(found)
    for columns in ("(adapter_pk, arrival_time)", "(tenant, arrival_time)", "(arrival_time)",
                    "(request_id)", "(seq, period)", "gin (text public.gin_trgm_ops)"):  # fmt: skip
        assert columns in defined, defined
    # on every partition, the one index that can serve each (the table is tiny: no seqscan)
    assert "_request_id_idx" in _plan(
        audit_target, "SELECT seq FROM completions WHERE request_id = 'x'"
    )
    assert "_text_idx" in _plan(audit_target, "SELECT seq FROM completions WHERE text LIKE '%abc%'")


def test_the_writer_keeps_the_rollup(audit_target, audit_redis):
    from audit_fixtures import FAST_WRITER

    from lorapool.audit_db import AuditWriter, WriterConfig
    from lorapool.audit_db.rollup import rolled_seq

    audit_redis.publish(_records(150, seed=9))
    config = WriterConfig(
        prefix=audit_redis.prefix, shards=audit_redis.shards, batch_size=40, rollup_rows=60,
        **FAST_WRITER,
    )  # fmt: skip
    stats = AuditWriter(audit_redis.conn, audit_target.engine, config).run(burst=True)
    with audit_target.engine.connect() as conn:
        assert rolled_seq(conn) == stats.rows_written == audit_target.count()  # idle: caught up
    for by in ("adapter", "tenant"):
        rolled = [
            (u.key, u.requests, u.errors) for u in usage(audit_target.engine, by, exact=False)
        ]
        exact = [(u.key, u.requests, u.errors) for u in usage(audit_target.engine, by, exact=True)]
        assert rolled == exact


def test_refreshes_add_up_to_the_rollup_of_every_row(audit_target):
    """Cells refreshed a few rows at a time (each refresh adds to cells stored by the
    ones before: counters and latency histograms, bucket by bucket) are the cells a
    rebuild from every row makes in one go."""
    from sqlalchemy import select

    from lorapool.audit_db.database import write_transaction
    from lorapool.audit_db.rollup import rebuild
    from lorapool.audit_db.schema import usage_daily

    def cells():
        with audit_target.engine.connect() as conn:
            rows = conn.execute(select(usage_daily)).mappings().all()
        return {(r["day"], r["dimension"], r["group_key"]): dict(r) for r in rows}

    records = _records(240, seed=13)
    for start in range(0, len(records), 30):  # eight transactions, a refresh after each
        chunk = records[start : start + 30]
        append_records(audit_target.engine, [record_from_dict(r) for r in chunk], key=KEY)
        refresh_rollup(audit_target.engine)
    refreshed = cells()
    with write_transaction(audit_target.engine) as conn:
        rebuild(conn)
    rebuilt = cells()
    assert refreshed == rebuilt
    assert sum(cell["requests"] for cell in rebuilt.values()) == 2 * len(records)
    assert any(sum(cell["latency_hist"].values()) > 1 for cell in rebuilt.values())
