"""CUDA graphs for decode steps, one per batch-size bucket (as vLLM captures them).

A decode step launches a few hundred small kernels whose launch time, on a
GPU, can exceed their run time. A graph replays the whole forward (logits
included) with one launch. Graphs have fixed shapes, so a step of n sequences
runs in the graph of the smallest captured size >= n, its inputs copied into
that graph's static buffers and the rows past n padded:

- a padding row writes no KV (slot -1, which the KV kernel skips), attends to
  one position of block 0 (``seq_len`` 1) and its logits are never read; rows
  are independent in every op, so padding changes no real row;
- block tables are padded to the widest a sequence can have
  (``max_model_len / block_size``), so the attention kernel's split of the
  context is fixed at capture; ``seq_lens`` bound what it reads.

A step runs eagerly when it is no pure decode step (a prefill, or prompt
logprobs), uses an adapter (the LoRA kernels' tiles depend on the batch's
adapter mix), or has more sequences than the largest graph. Only on CUDA;
``EngineArgs.enforce_eager`` (default True until measured) turns it off.
"""

from __future__ import annotations

import logging

import torch

from lorapool.engine.batch import BatchMetadata

logger = logging.getLogger(__name__)

# padding of a static row: (token, position, KV slot, sequence length)
PAD_TOKEN, PAD_POSITION, PAD_SLOT, PAD_SEQ_LEN = 0, 0, -1, 1


def default_sizes(max_num_seqs: int) -> list[int]:
    """vLLM's buckets: 1, 2, 4, then every multiple of 8 up to ``max_num_seqs`` (included)."""
    sizes = [s for s in (1, 2, 4) if s <= max_num_seqs]
    sizes += range(8, max_num_seqs + 1, 8)
    if sizes[-1] < max_num_seqs:
        sizes.append(max_num_seqs)
    return sorted(set(sizes))


def capture_sizes(configured: list[int] | None, max_num_seqs: int) -> list[int]:
    """The sizes to capture: the configured ones (at most ``max_num_seqs``) or the defaults."""
    sizes = default_sizes(max_num_seqs) if configured is None else configured
    return sorted({s for s in sizes if s <= max_num_seqs}) or [1]


def bucket(num_seqs: int, sizes: list[int]) -> int | None:
    """The smallest size that holds ``num_seqs`` sequences; None if none does."""
    return next((s for s in sizes if s >= num_seqs), None)


def graphable(batch: BatchMetadata, uses_lora: bool) -> bool:
    """Whether a step may run in a decode graph: one new token per sequence, each
    sampled, no adapter."""
    n = batch.num_seqs
    return not uses_lora and batch.num_tokens == n and batch.logits_indices.shape[0] == n


class StaticBatch:
    """A graph's input buffers for ``size`` sequences of at most ``max_blocks`` blocks."""

    def __init__(self, size: int, max_blocks: int, device: torch.device):
        long = dict(dtype=torch.long, device=device)
        i32 = dict(dtype=torch.int32, device=device)
        self.size = size
        self.batch = BatchMetadata(
            input_ids=torch.full((size,), PAD_TOKEN, **long),
            positions=torch.full((size,), PAD_POSITION, **long),
            slot_mapping=torch.full((size,), PAD_SLOT, **long),
            block_tables=torch.zeros((size, max_blocks), **i32),
            seq_lens=torch.full((size,), PAD_SEQ_LEN, **i32),
            query_start_loc=torch.arange(size + 1, **i32),
            logits_indices=torch.arange(size, **long),
        )

    def fill(self, batch: BatchMetadata) -> None:
        """Copy a decode batch of n <= size sequences in; rows past n become padding."""
        n, width = batch.num_seqs, batch.block_tables.shape[1]
        static = self.batch
        if n > self.size or width > static.block_tables.shape[1]:
            raise ValueError(
                f"a batch of {n} sequences and {width} blocks does not fit a graph of "
                f"{self.size} sequences and {static.block_tables.shape[1]} blocks"
            )
        for name, pad in (
            ("input_ids", PAD_TOKEN),
            ("positions", PAD_POSITION),
            ("slot_mapping", PAD_SLOT),
            ("seq_lens", PAD_SEQ_LEN),
        ):
            buffer = getattr(static, name)
            buffer[:n].copy_(getattr(batch, name), non_blocking=True)
            buffer[n:].fill_(pad)
        static.block_tables[:n, :width].copy_(batch.block_tables, non_blocking=True)
        static.block_tables[:n, width:].zero_()
        static.block_tables[n:].zero_()


class DecodeGraphs:
    """Captured decode graphs of one model runner; ``run`` replays the bucket of a batch.

    ``forward(batch) -> logits`` is the runner's eager forward (model and logits).
    ``enabled`` may be switched off to run eagerly (the GPU kit compares both).
    """

    def __init__(self, forward, sizes: list[int], max_blocks: int, device: torch.device):
        self.forward, self.sizes, self.device = forward, sizes, device
        self.max_blocks = max_blocks
        self.enabled, self.replays = True, 0
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, StaticBatch, torch.Tensor]] = {}

    def capture(self) -> None:
        """Capture every size, largest first, sharing one memory pool (as vLLM does)."""
        pool = None
        for size in reversed(self.sizes):
            static = StaticBatch(size, self.max_blocks, self.device)
            self.forward(static.batch)  # warm-up: Triton compiles outside the capture
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self.forward(static.batch)
            pool = graph.pool()
            self.graphs[size] = (graph, static, logits)
        torch.cuda.synchronize(self.device)
        logger.info("captured CUDA graphs for decode batches of %s sequences", self.sizes)

    def can_run(self, batch: BatchMetadata, uses_lora: bool) -> bool:
        return (
            self.enabled
            and graphable(batch, uses_lora)
            and bucket(batch.num_seqs, self.sizes) is not None
            and batch.block_tables.shape[1] <= self.max_blocks
        )

    def run(self, batch: BatchMetadata) -> torch.Tensor:
        """The logits [n, vocab] of a decode batch, by replaying its bucket's graph."""
        graph, static, logits = self.graphs[bucket(batch.num_seqs, self.sizes)]
        static.fill(batch)
        graph.replay()
        self.replays += 1
        return logits[: batch.num_seqs]
