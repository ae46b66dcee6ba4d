"""A job's two hashes have one home (``lorapool.records.marker``): every status the Lua
scripts write or compare is a ``JobStatus`` and every one is written by some script;
every field a script reads or writes on a marker is a ``JobMarker`` field and on a run
key a ``JobRun`` field, and every field of those Structs is written by some script
(issue 48 split them; issue 50 types them)."""

import re

from lorapool.batch.callbacks import ON_FINISH
from lorapool.lifecycle import append, run_state, submit, unread
from lorapool.records import marker
from lorapool.records.marker import MARKER_FIELDS, RESULT_FIELD, RUN_FIELDS, JobStatus
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

MARKER, RUN = "marker", "run"
# Each script's names for the two keys (MIGRATE's KEYS[1] is a marker of the first
# layout, which kept the run in it: a format of its own, only read, only by MIGRATE).
KEY_NAMES = {
    "SUBMIT": {"KEYS[1]": MARKER},
    "APPEND": {"job": MARKER, "run": RUN},
    "END_UNREAD": {"KEYS[1]": MARKER, "ARGV[2]": RUN},
    "END_RUNS": {"marker": MARKER, "run": RUN, "KEYS[k + 2]": RUN},
    "MIGRATE": {"KEYS[2]": RUN},
}
# a hash command (or END_UNREAD's ``field`` helper, an HGET) on a key, and its arguments
HASH_CALL = re.compile(r"(?:'(HSET|HGET|HMGET)',|\bfield\()\s*([\w\[\]+ ]+?),\s*([^)]*)\)")


def _arguments(text: str) -> list[str]:
    return [a.strip() for a in text.replace("\n", " ").split(",")]


def fields_used(script: str, names: dict[str, str]) -> dict[str, set[str]]:
    """The field names each key (marker, run) is read or written with in ``script``."""
    used: dict[str, set[str]] = {MARKER: set(), RUN: set()}
    for command, key, rest in HASH_CALL.findall(script):
        which = names.get(key.strip())
        if which is None:
            continue
        args = _arguments(rest)
        fields = args[::2] if command == "HSET" else args
        for name in fields:
            assert re.fullmatch(r"'\w+'", name), f"{key} {command}: field {name} not a literal"
            used[which].add(name.strip("'"))
    return used


def test_every_status_a_script_writes_or_compares_is_a_job_status():
    known = {s.value for s in JobStatus}
    for name, script in SCRIPTS.items():
        found = literals(WRITTEN, script) | literals(COMPARED, script)
        assert found <= known, (name, found - known)


def test_every_job_status_is_written_by_a_script():
    written = set().union(*(literals(WRITTEN, s) for s in SCRIPTS.values()))
    assert written == {s.value for s in JobStatus}


def test_every_field_a_script_uses_is_one_of_the_records():
    for name, script in SCRIPTS.items():
        used = fields_used(script, KEY_NAMES[name])
        assert used[MARKER] <= set(MARKER_FIELDS), (name, used[MARKER] - set(MARKER_FIELDS))
        assert used[RUN] <= set(RUN_FIELDS), (name, used[RUN] - set(RUN_FIELDS))


def test_every_field_of_the_records_is_used_by_a_script():
    used = [fields_used(s, KEY_NAMES[n]) for n, s in SCRIPTS.items()]
    assert set().union(*(u[MARKER] for u in used)) == set(MARKER_FIELDS)
    assert set().union(*(u[RUN] for u in used)) == set(RUN_FIELDS)


def test_the_fields_python_reads_are_the_records():
    assert RESULT_FIELD in RUN_FIELDS
    assert ON_FINISH in MARKER_FIELDS


def test_a_field_or_status_outside_the_records_is_caught():
    assert literals(WRITTEN, "redis.call('HSET', KEYS[1], 'status', 'done')") == {"done"}
    assert literals(COMPARED, "if m[1] == 'complete' then") == {"complete"}
    wrong = fields_used("redis.call('HSET', run, 'status', 'failed', 'done_at', t)", {"run": RUN})
    assert wrong[RUN] - set(RUN_FIELDS) == {"done_at"}
    read = fields_used("local m = redis.pcall('HMGET', job, 'entry', 'owner')", {"job": MARKER})
    assert read[MARKER] == {"entry", "owner"}


def test_readers_say_the_runs_status_and_queued_before():
    assert marker.job_status(b"finished", 1) == "finished"
    assert marker.job_status(None, 1) == "queued"
    assert marker.job_status(None, 0) is None
    assert marker.job_status(b"bogus", 0) == "queued"  # only workers write it


def literals(pattern: re.Pattern, text: str) -> set[str]:
    return {
        v
        for match in pattern.findall(text)
        for v in (match if isinstance(match, tuple) else (match,))
        if v
    }
