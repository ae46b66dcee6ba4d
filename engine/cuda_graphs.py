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

With adapters enabled, each size has a second graph for decode steps that use
adapters: the LoRA kernels' grid and tile rows must be fixed too, so that graph
runs them over ``max_tiles`` tiles of ``LORA_BLOCK_M`` rows (a step's real tiles
first, then empty ones, which touch nothing) at ``max_lora_rank`` (slots hold
zeros past an adapter's rank), its token order and tiles copied into static
buffers at each replay (``StaticLoRA``). The kernels return at once from an
empty tile; with ``EngineArgs.lora_live_work`` they also size their split of
the reduction by ``live_tiles``, the tiles a step of the bucket is expected
to fill, instead of ``max_tiles``.

A step runs eagerly when it is no pure decode step (a prefill, or prompt
logprobs) or has more sequences than the largest graph. Only on CUDA, and on by
default there; ``EngineArgs.enforce_eager`` turns it off.
"""

from __future__ import annotations

import logging

import torch

from lorapool.engine.batch import BatchMetadata
from lorapool.kernels import LoRAMapping

logger = logging.getLogger(__name__)

# padding of a static row: (token, position, KV slot, sequence length)
PAD_TOKEN, PAD_POSITION, PAD_SLOT, PAD_SEQ_LEN = 0, 0, -1, 1
LORA_BLOCK_M = 16  # rows of a LoRA tile in a graph (a decode step's adapters rarely share 16)


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


def graphable(batch: BatchMetadata) -> bool:
    """Whether a step may run in a decode graph: one new token per sequence, each sampled."""
    n = batch.num_seqs
    return batch.num_tokens == n and batch.logits_indices.shape[0] == n


def max_tiles(size: int, max_loras: int) -> int:
    """Tiles of ``LORA_BLOCK_M`` rows that ``size`` tokens of at most ``max_loras``
    adapters need at most: each adapter's tokens ceil(n / M) <= n / M + 1."""
    return -(-size // LORA_BLOCK_M) + min(size, max_loras)


def live_tiles(size: int, max_loras: int) -> int:
    """The tiles a graph of ``size`` tokens expects to be live, to size the kernels' work:
    those of ``size`` tokens spread evenly over min(size, max_loras) adapters, each
    adapter's share in ceil(share / M) tiles. It is the count of a full batch of the
    busiest mix the scheduler admits, at most ``max_tiles``; a step with fewer live
    tiles runs with a little more split than it needs, which costs far less than
    the idle programs of too little (decode LoRA is memory bound)."""
    adapters = min(size, max_loras)
    return adapters * -(-size // (adapters * LORA_BLOCK_M))


def padded_plan(host_slots, size: int, num_tiles: int) -> tuple[list[int], list[int]]:
    """(token order [size], tiles [3 * num_tiles] as starts, ends, slots) of a decode step
    whose tokens have ``host_slots`` (-1: no adapter), padded to ``size`` tokens of no
    adapter and ``num_tiles`` tiles, the unused ones empty (start = end)."""
    slots = list(host_slots) + [-1] * (size - len(host_slots))
    order = sorted(range(size), key=slots.__getitem__)  # stable: token order within a slot
    starts, ends, tile_slots = [], [], []
    i = 0
    while i < size:
        slot, j = slots[order[i]], i
        while j < size and slots[order[j]] == slot:
            j += 1
        if slot >= 0:
            for start in range(i, j, LORA_BLOCK_M):
                starts.append(start)
                ends.append(j)
                tile_slots.append(slot)
        i = j
    if len(starts) > num_tiles:
        raise ValueError(f"{len(starts)} LoRA tiles do not fit a graph of {num_tiles}")
    pad = [0] * (num_tiles - len(starts))
    return order, starts + pad + ends + pad + tile_slots + pad


class StaticLoRA:
    """A LoRA graph's token order and tiles: a ``LoRAMapping`` over static buffers."""

    def __init__(self, size: int, max_loras: int, device: torch.device):
        self.size, self.num_tiles = size, max_tiles(size, max_loras)
        self.order = torch.arange(size, dtype=torch.long, device=device)
        self.tiles = torch.zeros((3, self.num_tiles), dtype=torch.long, device=device)
        self.mapping = LoRAMapping(
            num_tokens=size,
            max_slot=max_loras - 1,
            segments=(),
            order=self.order,
            tiles=self.tiles,
            block_m=LORA_BLOCK_M,
            live_tiles=live_tiles(size, max_loras),
        )

    def fill(self, host_slots) -> None:
        order, tiles = padded_plan(host_slots, self.size, self.num_tiles)
        host = torch.tensor(order + tiles, dtype=torch.long)
        self.order.copy_(host[: self.size], non_blocking=True)
        self.tiles.view(-1).copy_(host[self.size :], non_blocking=True)


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
    ``lora``: the LoRA layers' shared ``LoRAStep``, ``max_loras`` and ``max_rank``
    when adapters are enabled (then each size also gets a graph for adapter steps).
    ``enabled`` may be switched off to run eagerly (the GPU kit compares both).
    """

    def __init__(self, forward, sizes: list[int], max_blocks: int, device: torch.device, lora=None):
        self.forward, self.sizes, self.device = forward, sizes, device
        self.max_blocks, self.lora = max_blocks, lora
        self.enabled, self.replays = True, 0
        self.graphs: dict[int, tuple] = {}  # size -> (graph, StaticBatch, logits)
        self.lora_graphs: dict[int, tuple] = {}  # size -> (graph, StaticBatch, logits, StaticLoRA)

    def capture(self) -> None:
        """Capture every size, largest first, sharing one memory pool (as vLLM does)."""
        pool = None
        for size in reversed(self.sizes):
            static = StaticBatch(size, self.max_blocks, self.device)
            graph, logits, pool = self._capture_one(static, pool)
            self.graphs[size] = (graph, static, logits)
            if self.lora is not None:
                step, max_loras, max_rank = self.lora
                static_lora = StaticLoRA(size, max_loras, self.device)
                step.set(static_lora.mapping, max_rank)
                try:
                    graph, logits, pool = self._capture_one(static, pool)
                finally:
                    step.set(None, 0)
                self.lora_graphs[size] = (graph, static, logits, static_lora)
        torch.cuda.synchronize(self.device)
        kinds = "base and adapter" if self.lora is not None else "base"
        logger.info(
            "captured CUDA graphs (%s) for decode batches of %s sequences", kinds, self.sizes
        )

    def _capture_one(self, static: StaticBatch, pool):
        self.forward(static.batch)  # warm-up: Triton compiles outside the capture
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            logits = self.forward(static.batch)
        return graph, logits, graph.pool()

    def can_run(self, batch: BatchMetadata, uses_lora: bool) -> bool:
        return (
            self.enabled
            and (not uses_lora or self.lora is not None)
            and graphable(batch)
            and bucket(batch.num_seqs, self.sizes) is not None
            and batch.block_tables.shape[1] <= self.max_blocks
        )

    def run(self, batch: BatchMetadata) -> torch.Tensor:
        """The logits [n, vocab] of a decode batch, by replaying its bucket's graph."""
        size = bucket(batch.num_seqs, self.sizes)
        if batch.uses_lora:
            graph, static, logits, static_lora = self.lora_graphs[size]
            static_lora.fill(self.lora[0].mapping.host_slots)  # the step's, set by the engine
        else:
            graph, static, logits = self.graphs[size]
        static.fill(batch)
        graph.replay()
        self.replays += 1
        return logits[: batch.num_seqs]
