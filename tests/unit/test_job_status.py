"""The job statuses have one home (``lifecycle.run_state.JobStatus``): every status the
Lua scripts write or compare is one of it, and every one of it is written by some script
(issue 48; issue 50 types the marker on it)."""

import re

from lorapool.lifecycle import append, run_state, submit, unread
from lorapool.lifecycle.run_state import JobStatus
from lorapool.worker import unread_audit

SCRIPTS = {
    "SUBMIT": submit.SUBMIT_SCRIPT,
    "APPEND": append.APPEND,
    "END_UNREAD": unread.END_UNREAD,
    "END_RUNS": unread_audit.END_RUNS,
    "MIGRATE": run_state.MIGRATE,
}
# 'status', '<literal>' in an HSET, and comparisons with a status variable
WRITTEN = re.compile(
    r"'HSET',\s*[\w\[\]+ ]+,\s*'status',\s*(?:dead ~= '' and )?'(\w+)'(?:\s*or\s*'(\w+)')?"
)
COMPARED = re.compile(r"(?:\bs|m\[1\]|status)\s*[~=]=\s*'(\w+)'")


def literals(pattern: re.Pattern, text: str) -> set[str]:
    return {
        v
        for match in pattern.findall(text)
        for v in (match if isinstance(match, tuple) else (match,))
        if v
    }


def test_every_status_a_script_writes_or_compares_is_a_job_status():
    known = {s.value for s in JobStatus}
    for name, script in SCRIPTS.items():
        found = literals(WRITTEN, script) | literals(COMPARED, script)
        assert found <= known, (name, found - known)


def test_every_job_status_is_written_by_a_script():
    written = set().union(*(literals(WRITTEN, s) for s in SCRIPTS.values()))
    assert written == {s.value for s in JobStatus}


def test_a_status_outside_the_enum_is_caught():
    assert literals(WRITTEN, "redis.call('HSET', KEYS[1], 'status', 'done')") == {"done"}
    assert literals(COMPARED, "if m[1] == 'complete' then") == {"complete"}


def test_readers_say_the_runs_status_and_queued_before():
    assert run_state.job_status(b"finished", 1) == "finished"
    assert run_state.job_status(None, 1) == "queued"
    assert run_state.job_status(None, 0) is None
    assert run_state.job_status(b"bogus", 0) == "queued"  # only workers write it
