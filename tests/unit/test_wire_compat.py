"""Every record an earlier version wrote to Redis stays readable.

``wire_fixtures/<commit>.json`` holds what the code of that commit wrote in a real run
(``wire_fixtures/make_fixtures.py``: the real producer, worker around the real engine,
and audit writer): jobs, chunks, final records, job hashes, audit records, dead letters,
the adapter registry, heartbeats and the pool's model record, each raw beside what that
commit's readers made of it. Here today's decoders read the raw records and must make
the same of them. A format change that cannot keep this is a version bump with a
migration note, and a new fixture file, never an edit of an old one.
"""

from __future__ import annotations

import base64
import re
import zlib
from pathlib import Path

import msgspec
import orjson
import pytest

from lorapool.lifecycle.chunk_log import decode_result
from lorapool.outputs import RequestMetrics
from lorapool.records.audit import RecordError, parse_record
from lorapool.records.chunk import decode_chunk, encode_chunk
from lorapool.records.dead_letter import decode_dead_letter
from lorapool.records.heartbeat import decode_heartbeat
from lorapool.records.job import decode_job

FIXTURES = sorted((Path(__file__).parent / "wire_fixtures").glob("*.json"))


def raw(value: dict[str, str]) -> bytes:
    return value["text"].encode() if "text" in value else base64.b64decode(value["b64"])


def plain(value):
    """``value`` as JSON would give it back (tuples as lists, int keys as strings)."""
    return orjson.loads(orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS))


# --- today's readers, giving what the fixtures' ``meaning`` holds -------------------------


def read_job(payload: bytes) -> dict:
    job = decode_job(payload)
    return {
        "request_id": job.request_id,
        "prompt": job.prompt,
        "prompt_token_ids": job.prompt_token_ids,
        "sampling_params": plain(job.sampling_params.to_dict()),
        "lora_request": None if job.lora_request is None else job.lora_request.to_dict(),
        "metadata": job.metadata,
        "arrival_time": job.arrival_time,
        "result_ttl_s": job.result_ttl_s,
        "messages": job.messages,
        **({"tools": job.tools} if job.tools is not None else {}),
    }


def read_chunk(chunk) -> dict:
    return {
        "seq": chunk.seq,
        "offset": chunk.offset,
        "finished": chunk.finished,
        "adapter_id": chunk.adapter_id,
        "num_tokens": chunk.num_tokens,
        "offsets": {str(o.index): chunk.offset_of(o) for o in chunk.outputs},
        "output": plain(chunk.to_output().to_dict()),
    }


def same_chunk(chunk, want: dict) -> bool:
    """``chunk`` read as ``want`` says; a fixture made before error kinds has none in its
    meaning: today's reader gives one exactly when there is an error (the old text
    rule's, ``records.error_kind.read_kind``)."""
    got = read_chunk(chunk)
    if "error_kind" not in want["output"]:
        kind = got["output"].pop("error_kind")
        assert (kind is None) == (want["output"]["error"] is None), kind
    return got == want


def read_audit(payload: bytes, key: str, pool: str) -> dict:
    return plain(parse_record(payload, key.encode(), pool).to_dict())


# --- the checks -----------------------------------------------------------------------------


@pytest.fixture(params=FIXTURES, ids=[p.stem for p in FIXTURES])
def fixture(request) -> dict:
    return orjson.loads(request.param.read_bytes())


def test_there_is_a_fixture_of_every_record():
    assert FIXTURES, "no wire fixtures: run tests/unit/wire_fixtures/make_fixtures.py"
    for path in FIXTURES:
        data = orjson.loads(path.read_bytes())
        assert len(data["jobs"]) >= 10 and len(data["audit"]) >= 10
        assert {"worker", "audit"} <= {
            raw(d["source"]).decode() if "source" in d else "worker" for d in data["dead_letters"]
        }
        chunks = [c for r in data["requests"].values() for c in r["chunks"]]
        assert any(c["meaning"]["output"]["error"] for c in chunks)
        assert any(c["meaning"]["output"]["outputs"][0]["logprobs"] for c in chunks)
        assert any(raw(r["final_record"]["raw"])[:1] == b"x" for r in data["requests"].values())
        assert data["adapters"] and data["workers"] and data["model"]


def test_jobs_decode_as_they_did(fixture):
    for job in fixture["jobs"]:
        want = job["meaning"]
        if "refused" in want:
            with pytest.raises(ValueError, match="JSON"):
                decode_job(raw(job["raw"]))
            continue
        got = read_job(raw(job["raw"]))
        if want["arrival_time"] == "now":  # none in the record: the time it is read
            want = {**want, "arrival_time": got["arrival_time"]}
        assert got == want


def test_chunks_and_final_records_decode_as_they_did(fixture):
    for rid, request in fixture["requests"].items():
        for chunk in request["chunks"]:
            assert same_chunk(decode_chunk(raw(chunk["raw"]), rid), chunk["meaning"]), rid
        record = request["final_record"]
        assert same_chunk(decode_result(raw(record["raw"]), rid), record["meaning"]), rid
        assert record["meaning"]["output"] == request["result"] or request["status"] == "failed"


WHOLE_METRICS = RequestMetrics(arrival_time=0).to_dict()


def test_what_today_writes_again_is_what_was_written(fixture):
    """Since ``records.chunk`` (msgspec Structs, no dict stage), a chunk or final record
    read and written again is the same bytes as the one read (``"f":1`` included, which
    APPEND's Lua looks for): the readers before it read what this writer writes (a pool
    mixing versions during a rolling upgrade)."""
    for rid, request in fixture["requests"].items():
        final = raw(request["final_record"]["raw"])
        final = zlib.decompress(final) if final[:1] == b"x" else final
        for payload in [raw(c["raw"]) for c in request["chunks"]] + [final]:
            again = encode_chunk(decode_chunk(payload))
            if b'"e":' in payload and b'"ek":' not in payload:  # before kinds: the old rule's
                again, kinds = re.subn(rb',"ek":"(engine|request)"', b"", again)
                assert kinds == 1
            if again != payload and b'"m":{' in payload:
                # the metrics of a request that failed or never ran held only the fields
                # known; since they are a RequestMetrics they are written whole (every
                # field, the others at their defaults), which the readers before read
                # (RequestMetrics(**dict)); the rest is the same bytes
                now, was = orjson.loads(again), orjson.loads(payload)
                assert now.pop("m") == {**WHOLE_METRICS, **was.pop("m")}, rid
                payload, again = orjson.dumps(was), orjson.dumps(now)
            assert again == payload, rid


def test_audit_records_verify_and_decode_as_they_did(fixture):
    key, pool = fixture["audit_key"], fixture["prefix"]
    signed = 0
    for record in fixture["audit"]:
        payload, want = raw(record["raw"]), record["meaning"]
        if "refused" in want:
            with pytest.raises(RecordError, match="unsigned"):
                parse_record(payload, key.encode(), pool)
            continue
        assert read_audit(payload, key, pool) == want
        signed += 1
        with pytest.raises(RecordError, match="bad signature"):  # the signature still binds
            parse_record(payload, key.encode(), pool + "-other")
    assert signed >= 9


def test_dead_letters_of_both_writers_read_as_one_shape(fixture):
    # before records.dead_letter, the worker's (APPEND: data, reason, entry, worker) and
    # the audit writer's (source, stream, id, reason, data); since, both DeadLetter's
    letters = [
        (d, decode_dead_letter({k.encode(): raw(v) for k, v in d.items()}))
        for d in fixture["dead_letters"]
    ]
    assert {letter.source for _, letter in letters} == {"worker", "audit"}
    for fields, letter in letters:
        text = {k: raw(v).decode() for k, v in fields.items() if k != "data"}
        assert letter.entry and letter.reason and letter.data == raw(fields["data"])
        assert letter.reason == text["reason"] and letter.entry == text.get("entry", text.get("id"))
        assert (letter.stream, letter.worker) == (text.get("stream"), text.get("worker"))
        assert letter.stream or letter.worker


def test_registry_heartbeat_and_model_records_read_as_they_did(fixture):
    from lorapool.records.adapter import decode_adapter_record as decode_adapter
    from lorapool.records.adapter import decode_model_identity

    for name, value in fixture["adapters"].items():
        record = decode_adapter(raw(value))  # every field typed (records.adapter)
        assert record.name == name and fixture["adapter_ids"][str(record.id)] == name
        assert record.to_dict() == orjson.loads(raw(value))  # all of it, as written
    for name, value in fixture["workers"].items():
        heartbeat = orjson.loads(raw(value))
        assert heartbeat["name"] == name
        assert {"running", "waiting", "loaded", "draining", "updated"} <= set(heartbeat)
        typed = decode_heartbeat(raw(value)).to_dict()  # records.heartbeat, every field
        assert {k: typed[k] for k in heartbeat} == heartbeat
    model = orjson.loads(raw(fixture["model"]))
    assert set(model) == {"name", "sha256"}
    typed = decode_model_identity(raw(fixture["model"]))  # what the gateway reads it as
    assert typed.to_dict() == model and msgspec.json.encode(typed) == raw(fixture["model"])
