"""What ``decode_job`` costs a worker per job (issue 36, the job as a msgspec record).

Runs on any build (the same calls before and after the job became typed): times
``decode_job(payload, JobLimits())`` for a typical job (16 prompt token ids,
``max_tokens=96``, an adapter, metadata), a chat job (4 messages) and large ones (a
500 KB prompt, ASCII and not), best of ``--rounds`` rounds of ``--number`` calls, and prints µs per
call as JSON. Alternate builds with ``PYTHONPATH=<tree> python benchmarks/job_decode.py``.
"""

from __future__ import annotations

import argparse
import json
import timeit

from lorapool.lifecycle.submit import build_job
from lorapool.protocol import LoRARequest, SamplingParams
from lorapool.records.job import JobLimits, decode_job, encode_job


def payloads() -> dict[str, bytes]:
    params = SamplingParams(max_tokens=96, temperature=0.7, top_p=0.9, seed=7, stop=["\n\n"])
    lora = LoRARequest("adapter-3", 3, "/adapters/3")
    meta = {"user": "u-17", "trace": "abc123"}
    chat = {"messages": [{"role": "user", "content": "hello there " * 20}] * 4}
    jobs = {
        "typical": build_job({"prompt_token_ids": list(range(16))}, params, lora, None, meta),
        "chat": build_job(chat, params, lora, None, meta),
        "large": build_job("x" * 500_000, params, None, None, meta),
        "large_utf8": build_job("é" * 250_000, params, None, None, meta),  # 500 KB too
    }
    return {name: encode_job(job) for name, job in jobs.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--number", type=int, default=2000)
    args = parser.parse_args()
    limits, out = JobLimits(), {}
    for name, payload in payloads().items():
        number = max(1, args.number // 40) if name.startswith("large") else args.number
        times = timeit.repeat(
            lambda p=payload: decode_job(p, limits), number=number, repeat=args.rounds
        )
        out[name] = round(min(times) / number * 1e6, 2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
