"""The records ``bench records`` (benchmarks/records.py) has every candidate encode."""

from __future__ import annotations

from lorapool.outputs import CompletionOutput, RequestMetrics
from lorapool.protocol import LoRARequest, SamplingParams
from lorapool.records import job as wire

LORA = LoRARequest("sql-lora", 7, "/adapters/sql-lora")
MIDDLE = CompletionOutput(0, " the", [1820], None, None)
FINAL = CompletionOutput(0, ".", [13], -12.5, None, "stop", None)
METRICS = RequestMetrics(1.7e9, 1.7e9 + 0.01, 1.7e9 + 0.05, 1.7e9 + 2.0, 1.7e9 + 2.0, 0.01)
METRICS.num_prompt_tokens, METRICS.num_generated_tokens = 16, 96
JOB = wire.Job(
    "6f1c2b9e8a7d4c3b2a1f0e9d8c7b6a5f",
    "Summarize the following text in one sentence: " + "lorem ipsum dolor sit amet " * 10,
    None,
    SamplingParams(temperature=0.7, top_p=0.95, max_tokens=128, stop=["\n\n"], seed=42),
    LORA,
    {"user": "u-123", "tenant": "acme"},
)
JOB_BYTES = wire.encode_job(JOB)
