"""EngineArgs: every engine option, validated once and passed down."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lorapool.engine.scheduler import SchedulerConfig

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30


@dataclass
class EngineArgs:
    """Options of one engine (vLLM's names where vLLM has the option)."""

    model: str
    tokenizer: str | None = None
    dtype: str = "auto"  # auto: float32 on CPU; on CUDA the checkpoint's fp16/bf16, else bf16
    device: str = "auto"  # auto: cuda when available
    seed: int = 0
    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes for the KV cache
    gpu_memory_utilization: float = 0.9  # share of the GPU's memory this engine may hold
    num_kv_blocks: int | None = None  # overrides kv_cache_memory
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_logprobs: int = 20
    enable_prefix_caching: bool = False
    # steps a waiting request may be skipped (no adapter slot, no free blocks) before
    # nothing behind it is admitted: its wait's bound (engine/scheduler.py)
    starvation_steps: int = 8
    # tenants' fair shares of this engine (engine/fair_share.py); False: first come,
    # first served whatever the tenant (requests without one are served so either way)
    tenant_fair_share: bool = True
    # while two or more tenants have work, the most prompt or recompute positions the
    # chunks of each but the least served take in a step (engine.contention)
    tenant_prefill_cap: int | None = None  # off (RESULTS.md)
    # CUDA graphs for decode steps (vLLM's flag and default): one graph per batch-size
    # bucket of cuda_graph_sizes, on CUDA only (a CPU engine runs eagerly whatever this
    # says). The GPU kit measured them on an H200 at 733426d (benchmarks/RESULTS.md): a
    # ~1B Llama's decode step at batch 64 took 3.17 ms with graphs against 10.6 eager,
    # 4.82 against 24.3 with 8 adapters, and decoded the same tokens (up to near ties
    # with adapters); True runs every step eagerly
    enforce_eager: bool = False
    cuda_graph_sizes: list[int] | None = None  # None: 1, 2, 4, then every 8 to max_num_seqs
    # fused Triton layer kernels (residual add + RMSNorm, RoPE + KV write, SiLU-mul) on
    # CUDA or under the interpreter: at most 10 launches a decoder layer instead of ~32.
    # Off until the GPU kit has measured it against the unfused path (issue 47).
    fused_layer_kernels: bool = False
    # multi-LoRA
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_dtype: str = "auto"
    adapter_roots: list[str] = field(default_factory=list)
    # the LoRA kernels' live-work path (kernels/lora_ops.py): two launches a projection,
    # split-K partials added inside the expand, split-K sized by the live tiles. Off (the
    # shrink, zeroing and torch.sum launches as before) until the GPU kit has measured both
    lora_live_work: bool = False
    # async output processing (engine.async_output; vLLM V0's, on by default there on
    # CUDA): the detokenizing, stop strings and outputs of the tokens past a request's
    # first done during the next step's forward and returned by the next step() call
    # (first tokens and ends at once). Off until the GPU kit has measured it; on the CPU
    # nothing overlaps
    async_output_proc: bool = False
    # async scheduling (engine.async_scheduling; vLLM V1's): a step's tokens (greedy, or
    # drawn; not a grammar's or a fork's) are read back after the next step is
    # scheduled, packed and queued, so the host's work overlaps the device's; outputs
    # come from the step() call after. Off until the GPU kit has measured it; on the CPU
    # nothing overlaps. Does async_output_proc's work
    async_scheduling: bool = False

    def __post_init__(self):
        _positive(
            self,
            "block_size",
            "max_num_seqs",
            "max_num_batched_tokens",
            "max_loras",
            "max_lora_rank",
            "starvation_steps",
        )
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be one of 8, 16, 32, 64, 128, got {self.block_size}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at "
                f"least max_num_seqs ({self.max_num_seqs})"
            )
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be auto or one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be at least "
                f"max_loras ({self.max_loras})"
            )
        if not isinstance(self.gpu_memory_utilization, (int, float)) or not (
            0 < self.gpu_memory_utilization <= 1
        ):
            raise ValueError(
                "gpu_memory_utilization must be a share in (0, 1], "
                f"got {self.gpu_memory_utilization!r}"
            )
        if self.cuda_graph_sizes is not None:
            self.cuda_graph_sizes = check_graph_sizes(self.cuda_graph_sizes)
        if self.async_scheduling and self.async_output_proc:
            raise ValueError(
                "async_scheduling and async_output_proc are exclusive: async scheduling "
                "makes a step's outputs while the next step runs already"
            )
        if self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be >= 0, got {self.max_logprobs}")

    def scheduler_config(self) -> SchedulerConfig:
        """The scheduler's config from these arguments (each checked there)."""
        return SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_loras=self.max_loras if self.enable_lora else None,
            starvation_steps=self.starvation_steps,
            fair_share=self.tenant_fair_share,
            contended_prefill_tokens=self.tenant_prefill_cap,
        )

    def resolve_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def resolve_dtype(self, device: torch.device, checkpoint_dtype: torch.dtype | None):
        if self.dtype != "auto":
            return _DTYPES[self.dtype]
        if device.type == "cpu":
            return torch.float32
        # as vLLM: a half-precision checkpoint runs as stored, a float32 one in bf16
        if isinstance(checkpoint_dtype, str):  # some configs keep the name
            checkpoint_dtype = _DTYPES.get(checkpoint_dtype.removeprefix("torch."))
        half = (torch.float16, torch.bfloat16)
        return checkpoint_dtype if checkpoint_dtype in half else torch.bfloat16

    def resolve_lora_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        return model_dtype if self.lora_dtype == "auto" else _DTYPES[self.lora_dtype]


def check_graph_sizes(sizes) -> list[int]:
    """CUDA graph batch sizes: positive ints, sorted, without duplicates."""
    if isinstance(sizes, (str, bytes)) or not hasattr(sizes, "__iter__"):
        raise ValueError(f"cuda_graph_sizes must be a list of batch sizes, got {sizes!r}")
    sizes = list(sizes)
    bad = [s for s in sizes if isinstance(s, bool) or not isinstance(s, int) or s < 1]
    if bad or not sizes:
        raise ValueError(f"cuda_graph_sizes must be positive ints, got {sizes!r}")
    return sorted(set(sizes))


def _positive(args: EngineArgs, *names: str) -> None:
    for name in names:
        value = getattr(args, name)
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
