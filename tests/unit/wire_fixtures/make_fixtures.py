"""Make the wire-compatibility fixtures: every record the pool writes to Redis, as the
code of one commit writes it, with what that commit's readers make of it.

Run from a checkout of the commit whose records are wanted (the file is named by the last
commit that changed the product's code):

    .venv/bin/python tests/unit/wire_fixtures/make_fixtures.py [--redis-url URL]

It builds a tiny random-weight llama with a tokenizer and a PEFT adapter (as the tests
do), submits jobs through the real ``Producer`` (plain, token ids, n > 1 with
logprobs, a chat, an adapter, stop strings, a result TTL, logit bias), fails some on
purpose (an unknown adapter, a prompt past the model's context, an entry that is not
JSON, an unsigned audit record), runs the real ``Worker`` around the real
``LLMEngine`` in burst mode and the real ``AuditWriter`` (SQLite), then reads back
everything they left in Redis, raw, beside its meaning as this commit's readers see
it (``meaning_*`` below: public types only). Writes ``<commit>.json`` next to this
script; ``tests/unit/test_wire_compat.py`` decodes the raw records with the code
of today and compares the meanings.

Redis: ``--redis-url``, else a private embedded server (``lorapool.embedded``).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
sys.path.insert(0, str(ROOT / "tests" / "support"))

PREFIX = "wirefix"
AUDIT_KEY = "lorapool-wire-fixture-audit-key-0123456789"
WORKER = "fixture-worker"
PRODUCT = ["lorapool", "worker", "producer", "gateway", "engine", "audit_db", "kernels"]
os.environ["LORAPOOL_AUDIT_KEY"] = AUDIT_KEY


# --- meanings: what a reader of this commit makes of each record (public types only) ----


def raw_of(value: bytes) -> dict[str, str]:
    """A raw Redis value: as text when it is UTF-8 JSON, else base64."""
    try:
        text = value.decode("utf-8")
    except UnicodeDecodeError:
        return {"b64": base64.b64encode(value).decode()}
    return {"text": text}


def meaning_output(output) -> dict:
    """A RequestOutput as plain data (its public ``to_dict``)."""
    return orjson.loads(orjson.dumps(output.to_dict()))


def meaning_chunk(chunk) -> dict:
    """A chunk: its position, adapter id, each completion's offset and its output."""
    return {
        "seq": chunk.seq,
        "offset": chunk.offset,
        "finished": chunk.finished,
        "adapter_id": chunk.adapter_id,
        "num_tokens": chunk.num_tokens,
        "offsets": {str(o.index): chunk.offset_of(o) for o in chunk.outputs},
        "output": meaning_output(chunk.to_output()),
    }


def meaning_job(job) -> dict:
    return {
        "request_id": job.request_id,
        "prompt": job.prompt,
        "prompt_token_ids": job.prompt_token_ids,
        "sampling_params": orjson.loads(orjson.dumps(job.sampling_params.to_dict())),
        "lora_request": None if job.lora_request is None else job.lora_request.to_dict(),
        "metadata": job.metadata,
        "arrival_time": job.arrival_time,
        "result_ttl_s": job.result_ttl_s,
        "messages": job.messages,
        **({"tools": job.tools} if getattr(job, "tools", None) is not None else {}),
    }


def meaning_audit(record) -> dict:
    return orjson.loads(orjson.dumps(record.to_dict()))


def fields_of(fields: dict) -> dict[str, dict[str, str]]:
    return {k.decode(): raw_of(v) for k, v in sorted(fields.items())}


# --- the run ---------------------------------------------------------------------------


def build_models(root: Path) -> tuple[Path, Path]:
    from adapters import build_adapter
    from tiny_models import build_tiny_model
    from tiny_tokenizer import build_tiny_tokenizer

    base = build_tiny_model("llama", root / "base", max_position_embeddings=256)
    build_tiny_tokenizer(base, vocab_size=512)
    adapter = build_adapter(base, root / "sql-lora", rank=4, seed=3)
    return base, adapter


def submit_jobs(conn, adapter: Path) -> dict[str, str]:
    """Jobs of every shape through the real producer; returns request id -> what it is."""
    from lorapool.producer import Producer
    from lorapool.protocol import LoRARequest, SamplingParams

    producer = Producer(conn, PREFIX)
    producer.registry.add("sql-lora", adapter, adapter_id=7)
    greedy = SamplingParams(temperature=0.0, max_tokens=6)
    jobs = {
        "plain": producer.submit("hello world", greedy, request_id="plain", metadata={"u": 1}),
        "ids-n2-logprobs": producer.submit(
            {"prompt_token_ids": [5, 6, 7, 8]},
            SamplingParams(n=2, temperature=0.8, seed=11, max_tokens=5, logprobs=2),
            request_id="ids-n2-logprobs",
        ),
        "adapter-stop": producer.submit(
            "the cat sat on",
            SamplingParams(temperature=0.0, max_tokens=8, stop=["zz"], output_kind="delta"),
            lora_request="sql-lora",
            request_id="adapter-stop",
            metadata={"user": "ü-ñ", "tags": ["a", {"b": None}]},
        ),
        "adapter-request": producer.submit(
            "one two",
            SamplingParams(temperature=0.0, max_tokens=4, logit_bias={"17": 5.0}),
            lora_request=LoRARequest("sql-lora", 7, str(adapter)),
            request_id="adapter-request",
        ),
        "chat": producer.submit(
            {"messages": [{"role": "user", "content": "hi there"}]},
            SamplingParams(temperature=0.0, max_tokens=5, output_kind="final_only"),
            request_id="chat",
        ),
        "structured": producer.submit(
            "yes or no?",
            SamplingParams(
                temperature=0.0, max_tokens=6, structured_outputs={"choice": ["yes", "no"]}
            ),
            request_id="structured",
        ),
        "too-long": producer.submit(
            {"prompt_token_ids": list(range(3, 300))}, greedy, request_id="too-long"
        ),
    }
    tool = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}
    chat = {"messages": [{"role": "user", "content": "weather?"}], "tools": [tool]}
    with contextlib.suppress(ValueError):  # a chat with tools: jobs carry them from 8a04db7
        jobs["chat-tools"] = producer.submit(
            chat, SamplingParams(temperature=0.0, max_tokens=4), request_id="chat-tools"
        )
    producer.result_ttl_s = 3600
    jobs["ttl"] = producer.submit("a b c", greedy, request_id="ttl")
    return {rid: handle.request_id for rid, handle in jobs.items()}


def poison(conn) -> None:
    """Entries a worker must fail: an unknown adapter, and one that is not JSON."""
    from lorapool.lifecycle.keys import Keys

    keys = Keys(PREFIX)
    ghost = {"lora_name": "ghost", "lora_int_id": 9, "lora_path": "/ghost"}
    job = {"v": 1, "request_id": "ghost-adapter", "prompt": "boo", "lora_request": ghost}
    conn.xadd(keys.requests, {"data": orjson.dumps(job)})
    conn.xadd(keys.requests, {"data": b"{not json"})
    # an audit record nobody signed: the audit writer dead-letters it
    conn.xadd(keys.audit, {"data": orjson.dumps({"v": 1, "request_id": "forged"})})


def run_worker(conn, base: Path):
    from lorapool.engine.config import EngineArgs
    from lorapool.engine.llm_engine import LLMEngine
    from lorapool.worker import Worker, WorkerConfig
    from lorapool.worker.serve import base_model_info

    engine = LLMEngine.from_engine_args(
        EngineArgs(model=str(base), enable_lora=True, max_loras=2, max_lora_rank=8)
    )
    config = WorkerConfig(prefix=PREFIX, name=WORKER, burst=True, lease_s=5, log_grace_s=3600)
    worker = Worker(engine, conn, config, base_model_info(str(base)))
    worker.run()
    worker.heartbeat()  # its record, once more, as ``lorapool status`` reads it


def run_audit_writer(conn, root: Path) -> None:
    from lorapool.audit_db.database import DatabaseConfig, create_audit_engine
    from lorapool.audit_db.writer import AuditWriter
    from lorapool.audit_db.writer_config import WriterConfig

    engine = create_audit_engine(DatabaseConfig(url=f"sqlite:///{root / 'audit.db'}"))
    config = WriterConfig(prefix=PREFIX, migrate=True, consumer="fixture-writer")
    AuditWriter(conn, engine, config).run(burst=True)


def collect_jobs(conn) -> list[dict]:
    """The job stream's entries (before a worker takes them: it trims what it ends)."""
    from lorapool.lifecycle.keys import Keys
    from lorapool.records.job import decode_job

    jobs = []
    for _, fields in conn.xrange(Keys(PREFIX).requests):
        raw = fields.get(b"data")
        try:
            meaning = meaning_job(decode_job(raw))
        except ValueError as exc:
            meaning = {"refused": str(exc)}
        if b'"arrival_time"' not in raw:  # a job without one arrives when it is decoded
            meaning["arrival_time"] = "now"
        jobs.append({"raw": raw_of(raw), "meaning": meaning})
    return jobs


def collect_audit(conn) -> list[dict]:
    """The audit stream's entries (before the writer stores and deletes them)."""
    from lorapool.lifecycle.keys import Keys
    from lorapool.records.audit import parse_record

    audits = []
    for _, fields in conn.xrange(Keys(PREFIX).audit):
        raw = fields[b"data"]
        try:
            meaning = meaning_audit(parse_record(raw, AUDIT_KEY.encode(), PREFIX))
        except ValueError as exc:
            meaning = {"refused": str(exc)}
        audits.append({"raw": raw_of(raw), "meaning": meaning})
    return audits


def collect(conn, requests: dict[str, str]) -> dict:
    """Everything the run left in Redis, raw, with this commit's meaning of it."""
    from lorapool.lifecycle.chunk_log import decode_result
    from lorapool.lifecycle.keys import Keys
    from lorapool.producer import Producer
    from lorapool.records.chunk import decode_chunk
    from lorapool.records.marker import RESULT_FIELD

    keys, producer = Keys(PREFIX), Producer(conn, PREFIX)
    out = {}
    for rid in sorted(requests.values()) + ["ghost-adapter"]:
        chunks = [
            {"raw": raw_of(raw), "meaning": meaning_chunk(decode_chunk(raw, rid))}
            for raw in conn.lrange(keys.out(rid), 0, -1)
        ]
        marker = {k.decode(): v for k, v in conn.hgetall(keys.job(rid)).items()}
        record = marker.get(RESULT_FIELD)
        handle = producer.handle(rid)
        out[rid] = {
            "chunks": chunks,
            "job_hash": {k: raw_of(v) for k, v in sorted(marker.items())},
            "final_record": None
            if record is None
            else {"raw": raw_of(record), "meaning": meaning_chunk(decode_result(record, rid))},
            "status": handle.status(),
            "result": meaning_output(handle.result(timeout=5)),
            "stream": [meaning_output(o) for o in handle.stream(timeout=5)],
        }
    return {
        "requests": out,
        "dead_letters": [fields_of(f) for _, f in conn.xrange(keys.dead)],
        "adapters": {k.decode(): raw_of(v) for k, v in conn.hgetall(keys.adapters).items()},
        "adapter_ids": {k.decode(): v.decode() for k, v in conn.hgetall(keys.adapter_ids).items()},
        "workers": {k.decode(): raw_of(v) for k, v in conn.hgetall(keys.workers).items()},
        "model": raw_of(conn.get(keys.model)),
    }


def _redis(url: str | None, root: Path):
    import redis

    if url:
        return redis.Redis.from_url(url), None
    from lorapool.embedded import EmbeddedServer

    server = EmbeddedServer(root / "redis", persist=False).start()
    return redis.Redis.from_url(server.url), server


def main() -> Path:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--redis-url")
    args = parser.parse_args()
    commit = subprocess.run(  # the last commit of the code that wrote the records
        ["git", "-C", str(ROOT), "log", "-1", "--format=%h", "--", *PRODUCT],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        conn, server = _redis(args.redis_url, root)
        try:
            for key in conn.scan_iter(f"{PREFIX}:*"):
                conn.delete(key)
            base, adapter = build_models(root)
            requests = submit_jobs(conn, adapter)
            poison(conn)
            jobs = collect_jobs(conn)
            run_worker(conn, base)
            audit = collect_audit(conn)
            run_audit_writer(conn, root)
            fixture = {
                "commit": commit,
                "made": time.strftime("%Y-%m-%d"),
                "prefix": PREFIX,
                "audit_key": AUDIT_KEY,
                "jobs": jobs,
                "audit": audit,
                **collect(conn, requests),
            }
            for key in conn.scan_iter(f"{PREFIX}:*"):
                conn.delete(key)
        finally:
            if server is not None:
                server.stop()
    path = HERE / f"{commit}.json"
    path.write_bytes(orjson.dumps(fixture, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS))
    print(f"wrote {path} ({path.stat().st_size} bytes)")
    return path


if __name__ == "__main__":
    main()
