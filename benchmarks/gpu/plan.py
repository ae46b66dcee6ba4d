"""What the kit runs in each mode: sections, time boxes, shapes, model sizes, workloads.

Two modes run the same code: the full run on a GPU (two calls, ``PARTS``, of at
most 8 minutes each on an H100, warm-up included) and ``--tiny`` (tiny shapes, the
CPU dry run of CI, under 2 minutes on a 2-core box). Every number that sizes the
run lives here.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

SECTIONS = ("device", "kernels", "sweep", "engine", "throughput", "big", "queue", "tenants")

# Seconds per section (the whole-run budget, the boxes of the sections asked for + 30 s
# for interpreter starts and the reports, caps them too). On an H200 (733426d, 5a6215d)
# the sections took: kernels 39, engine 100-106 (the Qwen3 LoRA check included),
# throughput 60-70, queue 56 before it asked for logprobs and ran its wrong-adapter
# probes, ~90 after (its 80 s box cut it short). The boxes of the sections issue 47
# added or grew are estimates, not yet measured on a GPU (below).
FULL_BOXES = {
    "device": 15,
    "kernels": 65,
    "sweep": 90,
    "engine": 150,
    "throughput": 150,
    "big": 90,
    "queue": 190,
    "tenants": 240,
}
# Issue 47 added the sweep (~50 s: ~145 launches compiled in 16 processes, each timed by
# 50 graph replays), the 8B shape (~60 s: random weights drawn on the device, 8 adapters
# written, graphs at 64 and 256), the decode step at batch 256 with each engine flag on
# and off (throughput ~110-130 s: an engine per flag) and a second worker with the
# production settings (queue ~+50 s). All of it (780 s of boxes) no longer fits one
# 8-minute call: ``PARTS`` splits it in two calls of at most 8 minutes each (boxes
# 360 + 30 and 405 + 30 s; expected ~250 and ~300 s). The base model's decode step
# sampled at temperature 1 (graphs, batch 64 and 256) adds an estimated ~5 s to
# throughput: 4 runs of 64 steps at ~4-15 ms (0.07 s in the dry run); its box holds it.
# With top_p 0.95 too ("nucleus"), for the base engine and async scheduling's: ~5 s more.
PARTS = {
    "1": ("device", "kernels", "sweep", "queue"),
    "2": ("device", "engine", "throughput", "big"),
    "3": ("device", "tenants"),
}
# Part 3 (issue 51's hostile tenant with the worker on the GPU, ``tenants``): the ~1B
# model built and written (~30 s), the worker's start (graphs) and 2 rounds of 15 s alone
# and 15 s attacked; an estimate (~150 s), not yet measured on a GPU. It is a third call:
# after parts 2 and 1, or in place of part 1 when issue 51's figure is the one wanted.
# The dry run takes ~40 s on an idle 2-core box; the boxes leave room for a loaded one
# (CI, 2026-12-06: queue's two worker starts took 18 s each and its 55 s box cut it).
TINY_BOXES = {
    "device": 10,
    "kernels": 25,
    "sweep": 90,
    "engine": 45,
    "throughput": 45,
    "big": 25,
    "queue": 120,
    "tenants": 90,
}


@dataclass(frozen=True)
class ModelShape:
    """A random-weight model generated on the device (transformers config fields)."""

    name: str
    arch: str  # llama | qwen3
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    head_dim: int | None = None
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096


# ~1B Llama (Llama-3.2-1B's shape, vocab cut to 32k so building takes seconds) and
# Qwen3-0.6B's shape: nothing downloaded, weights drawn on the device.
LLAMA_1B = ModelShape("llama-1b", "llama", 2048, 8192, 16, 32, 8, 32000)
# Llama-3.1-8B's shape (16 GB of weights in bf16): built on the device by the engine alone
# (``big_model``), never written to disk nor loaded by transformers.
LLAMA_8B = ModelShape("llama-8b", "llama", 4096, 14336, 32, 32, 8, 128256)
QWEN3_SMALL = ModelShape("qwen3-0.6b", "qwen3", 1024, 3072, 28, 16, 8, 151936, 128, True)
TINY_LLAMA = ModelShape("tiny-llama", "llama", 64, 128, 2, 4, 2, 512, max_position_embeddings=512)
TINY_QWEN3 = ModelShape("tiny-qwen3", "qwen3", 64, 128, 3, 4, 2, 512, 32, True, 512)
TINY_BIG = ModelShape("tiny-big", "llama", 128, 256, 2, 4, 2, 1024, max_position_embeddings=512)


@dataclass(frozen=True)
class Sizes:
    """Workloads of the engine, throughput and queue sections."""

    models: tuple[ModelShape, ...]
    parity_prompts: int = 8  # greedy parity requests per model and dtype
    parity_tokens: int = 32
    bf16_exact_tokens: int = 4  # bf16 must match fp32 transformers on this many first tokens
    lora_ranks: tuple[int, ...] = (8, 16, 32, 64)
    batch: int = 64  # throughput: requests at once
    new_tokens: int = 256
    prompt_len: int = 128
    adapter_counts: tuple[int, ...] = (8, 64)
    adapter_rank: int = 16
    decode_tokens: int = 64  # decode-step timing: tokens per request
    decode_batches: tuple[int, ...] = (64, 256)  # decode-step timing: sequences at once
    graph_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)  # and decode_batches
    # engine speed flags measured on against off in one run (``flags``), in this order
    # (the throughput section's box may cut the last)
    engine_flags: tuple[str, ...] = (
        "fused_layer_kernels",
        "lora_live_work",
        "async_scheduling",
        "async_output_proc",
    )
    big_model: ModelShape | None = None  # the ``big`` section's shape (random, on the device)
    big_adapters: int = 8
    sweep_candidates: int = 5  # per op and shape in the sweep, besides the old launch
    sweep_batches: tuple[int, ...] | None = None  # the sweep's batches: decode_batches'
    gpu_memory_utilization: float = 0.85
    queue_requests: int = 256
    queue_adapters: int = 8
    queue_tokens: int = 64
    copy_bytes: int = 1 << 30
    kernel_shapes: str = "full"
    tenants_seconds: float = 15.0  # each phase of the hostile-tenant bench (alone, attacked)
    tenants_rounds: int = 2
    tenants_streams: int = 500  # job-event streams the hostile tenant holds


FULL = Sizes(models=(LLAMA_1B, QWEN3_SMALL), big_model=LLAMA_8B)
TINY = Sizes(
    models=(TINY_LLAMA, TINY_QWEN3),
    parity_prompts=3,
    parity_tokens=8,
    lora_ranks=(4, 8),
    batch=8,
    new_tokens=8,
    prompt_len=8,
    adapter_counts=(2, 4),
    adapter_rank=4,
    decode_tokens=6,
    decode_batches=(4, 8),
    graph_sizes=(1, 2, 4, 8),
    engine_flags=("fused_layer_kernels", "lora_live_work", "async_scheduling", "async_output_proc"),
    big_model=TINY_BIG,
    big_adapters=2,
    sweep_candidates=1,
    sweep_batches=(4,),  # interpreted: both batches 22 s on an idle 2-core box, > 90 s in CI
    queue_requests=24,
    queue_adapters=3,
    queue_tokens=6,
    copy_bytes=16 << 20,
    kernel_shapes="tiny",
    tenants_seconds=3.0,
    tenants_rounds=1,
    tenants_streams=20,
)


@dataclass
class Context:
    """What the parent hands a section's process (as a JSON file)."""

    device: str  # cuda | cpu
    tiny: bool
    workdir: str  # shared by the sections: models and adapters built once
    deadline: float  # time.time() by which the section must be done
    earlier: dict = field(default_factory=dict)  # name -> figures of the sections before
    out: str = ""  # the run's report directory (files a section hands back: the sweep's)

    @property
    def sizes(self) -> Sizes:
        return TINY if self.tiny else FULL

    @property
    def margin(self) -> float:
        """Seconds a section keeps in hand before its deadline when it starts a step."""
        return 2.0 if self.tiny else 15.0

    def time_left(self) -> float:
        return self.deadline - time.time() - self.margin

    @property
    def copy_gbps(self) -> float | None:
        return self.earlier.get("device", {}).get("copy_GBps")

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self)))

    @classmethod
    def load(cls, path: Path) -> Context:
        return cls(**json.loads(Path(path).read_text()))
