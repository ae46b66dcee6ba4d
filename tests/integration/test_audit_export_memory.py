"""A streamed export of 200,000 rows stays under 100 MB (SQLite and PostgreSQL): the
resident memory of this test process, sampled while ``lorapool audit export`` writes
every row to a file. The rows are made with one INSERT ... SELECT (the test is about
the export's memory, not the writer), each with 1 KB of text: about 200 MB of rows
that a list-building export would hold at once."""

import os
import threading
import time

import orjson
import pytest
from click.testing import CliRunner
from sqlalchemy import text

from lorapool.cli.audit import audit

pytest_plugins = ["audit_fixtures"]
pytestmark = pytest.mark.integration
ROWS = 200_000
BOUND_MB = 100
PAGE = os.sysconf("SC_PAGE_SIZE")

_COLUMNS = (
    "seq, pool, request_id, completion_index, base_model_name, base_model_sha256, prompt, "
    "num_prompt_tokens, text, num_output_tokens, finish_reason, sampling_params, "
    "request_metadata, tenant, worker, arrival_time, written_at, prev_hash, row_hash, "
    "chain_version, prompt_tokens, output_tokens, period"
)


def _fill(target) -> None:
    if target.kind == "postgresql":
        with target.engine.begin() as conn:
            conn.execute(text("SELECT audit_ensure_period(202601)"))
            conn.execute(
                text(
                    f"INSERT INTO completions ({_COLUMNS}) SELECT i, 'p', 'req-' || i, 0, 'm', "
                    "'s', 'prompt', 3, repeat('x', 1000) || i, 3, 'stop', '{}', '{}', 't', 'w', "
                    "1767225600 + i, 1767225600 + i, repeat('0', 64), repeat('0', 64), 2, "
                    "'\\x010000000200000003000000', '\\x040000000500000006000000', 202601 "
                    "FROM generate_series(1, :n) AS i"
                ),
                {"n": ROWS},
            )
        return
    with target.engine.begin() as conn:
        conn.execute(
            text(
                "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < :n) "
                f"INSERT INTO completions ({_COLUMNS}) SELECT i, 'p', 'req-' || i, 0, 'm', 's', "
                "'prompt', 3, printf('%.1000c', 'x') || i, 3, 'stop', '{}', '{}', 't', 'w', "
                "1767225600 + i, 1767225600 + i, printf('%.64c', '0'), printf('%.64c', '0'), 2, "
                "x'010000000200000003000000', x'040000000500000006000000', 202601 FROM n"
            ),
            {"n": ROWS},
        )


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class _PeakRSS:
    """The highest resident size above the start, sampled every 5 ms."""

    def __enter__(self):
        self.start, self.peak, self._done = _rss(), 0, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._done.wait(0.005):
            self.peak = max(self.peak, _rss() - self.start)

    def __exit__(self, *exc):
        self._done.set()
        self._thread.join()


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc (Linux)")
def test_a_streamed_export_of_200k_rows_stays_under_100_mb(audit_target, tmp_path):
    _fill(audit_target)
    out = tmp_path / "export.jsonl"
    started = time.monotonic()
    with _PeakRSS() as memory:
        result = CliRunner().invoke(
            audit, [*audit_target.cli_args(), "export", "--format", "jsonl", "-o", str(out)]
        )
    assert result.exit_code == 0, result.output
    elapsed = time.monotonic() - started
    with out.open("rb") as f:
        lines = sum(1 for _ in f)
        f.seek(0)
        first = orjson.loads(f.readline())
    assert lines == ROWS and first["text"] == "x" * 1000 + "1"
    assert first["prompt_token_ids"] == [1, 2, 3] and first["token_ids"] == [4, 5, 6]
    assert out.stat().st_size > 2 * BOUND_MB * 1024 * 1024  # more than the bound, twice
    assert memory.peak < BOUND_MB * 1024 * 1024, (
        f"peak {memory.peak / 2**20:.0f} MB above the start ({elapsed:.1f} s)"
    )
