"""The hostile producer of the stateful queue test (tests/integration/test_queue_stateful.py,
issue 48 Build 2): rules a ``RuleBasedStateMachine`` inherits, each a command the
documented producer ACL user may run (docs/redis-acl.md), sent as that user
(``self.hostile``), on any id its patterns match: the honest producer's jobs (another
tenant's), ids not yet submitted, and its own. And the invariant every audit record
must hold whatever it did: the output a worker produced for that id (the stand-in
engine's ``token_of``), or a never-ran record with no output.

The machine provides ``keys``, ``conn`` (an admin client), ``hostile``, ``count`` (the
next honest id's number), ``submitted`` and ``may_lose`` (ids whose reader may get
JobLost: the hostile producer emptied or expired their marker).
"""

from __future__ import annotations

import contextlib
import time

import redis
from deployment_pool import acl_rules
from hypothesis import strategies as st
from hypothesis.stateful import rule

from lorapool.lifecycle.chunk_log import encode_result
from lorapool.lifecycle.submit import Submit, build_job
from lorapool.protocol import SamplingParams
from lorapool.records.audit import parse_record
from lorapool.records.chunk import Chunk, Delta
from lorapool.records.job import encode_job

FORGED = "FORGED by a producer"
FIELDS = ("status", "result", "unread", "unread_log", "submitted", "entry", "priority")
STATUSES = ("queued", "finished", "failed", "running")
ENTRIES = ("1-1", "0-0", "x", "99999999999999-0", "")


@contextlib.contextmanager
def wrong_type_ok():
    """A command Redis refuses for the key's type (an operator's SET of it): refused, as it
    would be for the producer, and nothing written; an ACL refusal is not hidden."""
    try:
        yield
    except redis.ResponseError as exc:
        if "WRONGTYPE" not in str(exc) or isinstance(exc, redis.exceptions.NoPermissionError):
            raise


def forged_result(rid: str) -> bytes:
    delta = Delta(text=FORGED, token_ids=[7, 7, 7], finish_reason="stop")
    return encode_result(Chunk(request_id=rid, seq=1, outputs=[delta], finished=True))


class HostileProducer:
    """Rules of a producer that writes what its ACL user may into other jobs' keys."""

    def producer_user(self) -> None:
        """The doc's producer user for the machine's prefix (password ``pw``)."""
        line = acl_rules()["producer"].replace("lorapool:", f"{self.keys.prefix}:")
        words = ["ACL", "SETUSER", *line.replace(">CHANGE-ME", ">pw").split()[2:]]
        self.conn.execute_command(*words)

    def _target(self, data) -> str:
        """An honest job's id, an id not yet submitted (the next ones), or its own."""
        future = [f"r{self.count + k}" for k in range(3)]
        rid = data.draw(st.sampled_from(sorted(self.submitted) + future + ["hostile-own"]))
        self.touched = getattr(self, "touched", set()) | {rid}
        return rid

    def _value(self, data, rid: str, field: str):
        if field == "status":
            return data.draw(st.sampled_from(STATUSES))
        if field == "result":
            return forged_result(rid)
        if field == "entry":
            others = [e.decode() for e in self._entries()]
            return data.draw(st.sampled_from(list(ENTRIES) + others))
        if field == "priority":
            return data.draw(st.sampled_from(["interactive", "batch", "nope"]))
        return time.time()

    def _entries(self) -> list[bytes]:
        return [entry for entry, _ in self.conn.xrange(self.keys.requests, count=20)]

    @rule(data=st.data(), fields=st.sets(st.sampled_from(FIELDS), min_size=1))
    def hostile_forge_marker(self, data, fields):
        rid = self._target(data)
        mapping = {f: self._value(data, rid, f) for f in sorted(fields)}
        with wrong_type_ok():
            self.hostile.hset(self.keys.job(rid), mapping=mapping)

    @rule(data=st.data(), entry=st.sampled_from([None, *ENTRIES]))
    def hostile_forge_ended(self, data, entry):
        """Row A of issue 48 as filed: a marker saying a reader ended the request after
        a partial run, with a forged final record, and its id pushed for the workers."""
        rid = self._target(data)
        fields = {"status": "failed", "unread": time.time(), "unread_log": 1}
        fields |= {"submitted": time.time(), "result": forged_result(rid)}
        with wrong_type_ok():
            entry_field = {"entry": entry} if entry else {}
            self.hostile.hset(self.keys.job(rid), mapping=fields | entry_field)
        self.hostile.rpush(self.keys.unread_ended, rid)

    @rule(data=st.data())
    def hostile_mark_finished(self, data):
        """Row B of issue 48: another tenant's job marked finished."""
        with wrong_type_ok():
            self.hostile.hset(self.keys.job(self._target(data)), "status", "finished")

    @rule(data=st.data(), fields=st.sets(st.sampled_from(FIELDS), min_size=1))
    def hostile_hdel_marker(self, data, fields):
        rid = self._target(data)
        with wrong_type_ok():
            self.hostile.hdel(self.keys.job(rid), *sorted(fields))
        self.may_lose.add(rid)  # a marker emptied (deleted): its reader may get JobLost

    @rule(data=st.data())
    def hostile_expire_marker(self, data):
        rid = self._target(data)
        self.hostile.expire(self.keys.job(rid), 1)
        self.may_lose.add(rid)

    @rule(data=st.data(), times=st.integers(1, 3))
    def hostile_push_ended(self, data, times):
        rid = self._target(data)
        for _ in range(times):
            self.hostile.rpush(self.keys.unread_ended, rid)

    @rule(data=st.data(), tokens=st.integers(1, 30))
    def hostile_xadd(self, data, tokens):
        """A raw job of another's id (or a new one), its own parameters."""
        rid = self._target(data)
        params = SamplingParams(max_tokens=tokens, ignore_eos=True)
        job = build_job({"prompt_token_ids": [9]}, params, None, rid, None)
        self.hostile.xadd(self.keys.requests, {"data": encode_job(job)})

    @rule(data=st.data(), priority=st.sampled_from(["interactive", "batch"]))
    def hostile_submit(self, data, priority):
        """EVALSHA of the submit script, for any id."""
        rid = self._target(data)
        job = build_job({"prompt_token_ids": [9]}, SamplingParams(max_tokens=3), None, rid, None)
        with wrong_type_ok():  # the script's HGET of a marker of another type
            Submit(self.hostile, self.keys)([job], priority, "")

    @rule(data=st.data())
    def hostile_abort(self, data):
        self.hostile.set(self.keys.abort(self._target(data)), 1, ex=60)

    def check_audit_outputs(self, audit_key: bytes, lossy: set[str]) -> dict[str, int]:
        """Every audit record is signed and holds what a worker produced for its id: the
        stand-in's tokens from the first, or no output at all (never run); never the
        forged text. For ids in ``lossy`` (an operator deleted their log or marker, or a
        restart lost them) only the last: a worker that takes over a run whose log lost
        its head resumes from what the log holds (a gap of the failover, not of this
        issue). Returns the records per id."""
        from standin import load

        bench, counts = load(), {}
        for _, fields in self.conn.xrange(self.keys.audit):
            record = parse_record(fields[b"data"], audit_key, self.keys.prefix)
            rid = record.request_id
            counts[rid] = counts.get(rid, 0) + 1
            for output in record.outputs:
                tokens = list(output.token_ids)
                assert FORGED not in output.text, rid
                if rid in lossy:
                    continue
                assert tokens == [bench.token_of(rid, k) for k in range(len(tokens))], rid
                if not tokens:
                    assert output.text == "", rid
        return counts
