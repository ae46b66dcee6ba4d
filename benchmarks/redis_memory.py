"""What one request costs in Redis memory, measured with MEMORY USAGE on a real server.

Runs requests of 8 and 64 output tokens through the real worker (SmolLM2 on
this machine's device) and reports, per request: the queued entry on
``{p}:requests`` and its job marker while it waits, then what stays after it
finished: the chunk log for the log's grace, the job marker holding the whole output
(compacted) until the result TTL, and the audit record
on ``{p}:audit`` until the writer has committed it.

    lorapool bench redis_memory [--model DIR] [--redis-url URL]

Uses its own key prefix and deletes it afterwards.
"""

from __future__ import annotations

import argparse
import json
import uuid

import redis

from lorapool.producer import Producer
from lorapool.protocol import SamplingParams

PROMPT = "Write one sentence about the sea, and then another about the sky."


def stream_entry_bytes(conn, key: str) -> float:
    """Bytes per entry of a stream (MEMORY USAGE of all nodes / entries)."""
    length = conn.xlen(key)
    return conn.memory_usage(key, samples=0) / length if length else 0.0


def measure(conn, model: str, tokens: int, count: int = 8) -> dict:
    from lorapool.engine.config import EngineArgs
    from lorapool.engine.llm_engine import LLMEngine
    from lorapool.identity import model_identity
    from lorapool.worker import Worker, WorkerConfig

    prefix = f"bench-mem-{uuid.uuid4().hex[:8]}"
    producer = Producer(conn, prefix=prefix)
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    try:
        handles = producer.submit_many([PROMPT] * count, params)
        queued = stream_entry_bytes(conn, producer.keys.requests)
        marker = conn.memory_usage(producer.keys.job(handles[0].request_id), samples=0)
        engine = LLMEngine.from_engine_args(EngineArgs(model=model, max_num_seqs=count))
        config = WorkerConfig(prefix=prefix, burst=True, insecure_no_key=True)
        Worker(engine, conn, config, model_identity(model)).run()
        logs = [conn.memory_usage(producer.keys.out(h.request_id), samples=0) for h in handles]
        markers = [conn.memory_usage(producer.keys.job(h.request_id), samples=0) for h in handles]
        chunks = conn.llen(producer.keys.out(handles[0].request_id))
        return {
            "output_tokens": tokens,
            "queued_entry_bytes": round(queued),
            "queued_marker_bytes": marker,
            "chunks_per_request": chunks,
            "chunk_log_bytes": round(sum(logs) / count),
            "finished_marker_bytes": round(sum(markers) / count),
            "audit_record_bytes": round(stream_entry_bytes(conn, producer.keys.audit)),
            "kept_for_grace_bytes": round((sum(logs) + sum(markers)) / count),
            "kept_until_ttl_bytes": round(sum(markers) / count),
        }
    finally:
        for key in conn.scan_iter(f"{prefix}:*"):
            conn.delete(key)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model directory (default: SmolLM2)")
    parser.add_argument("--redis-url", default=None)
    parser.add_argument("--tokens", type=int, nargs="+", default=[8, 64])
    args = parser.parse_args(argv)
    if args.model is None:
        from lorapool.settings import smollm2_dir

        args.model = str(smollm2_dir())
    if args.redis_url is None:
        from lorapool.embedded import resolve_url

        args.redis_url = resolve_url()
    conn = redis.Redis.from_url(args.redis_url)
    for tokens in args.tokens:
        print(json.dumps(measure(conn, args.model, tokens)), flush=True)


if __name__ == "__main__":
    main()
