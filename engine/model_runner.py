"""Runs one scheduled step through the model over the paged KV cache."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from itertools import chain

import torch
from transformers import AutoConfig

from lorapool import kernels
from lorapool.engine.batch import BatchMetadata
from lorapool.engine.block_manager import BlockManager
from lorapool.engine.config import DEFAULT_CPU_KV_CACHE_BYTES, EngineArgs
from lorapool.engine.cuda_graphs import DecodeGraphs, capture_sizes
from lorapool.engine.kv_budget import activation_reserve, kv_cache_budget
from lorapool.engine.loader import load_model
from lorapool.engine.scheduler import ScheduledSeq, SchedulerOutput

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class LogitsRows:
    """Where one scheduled sequence's rows sit in the step's logits."""

    item: ScheduledSeq
    prompt_rows: range  # rows predicting prompt tokens start+1 .. (prompt logprobs)
    sample_row: int | None  # row to sample the next token from


def pack_batch(device: torch.device, longs, ints, tables: list[list[int]]) -> BatchMetadata:
    """A BatchMetadata whose tensors are views of one buffer, copied to ``device`` once.

    ``longs``: (input_ids, positions, slot_mapping, logits_indices), int64;
    ``ints``: (seq_lens, query_start_loc, lora_slots or None), int32 on the device;
    ``tables``: the block tables, padded with 0 to the widest. The int32 part is
    converted on the device by one op after the copy.
    """
    width = max(map(len, tables))
    flat = list(chain(*longs, *(x for x in ints if x is not None)))
    for table in tables:
        flat += table
        flat += [0] * (width - len(table))
    host = torch.tensor(flat, dtype=torch.long, pin_memory=device.type == "cuda")
    moved = host.to(device, non_blocking=True)
    num_longs = sum(map(len, longs))
    as_int = moved[num_longs:].to(torch.int32)
    views, at = [], 0
    for part in longs:
        views.append(moved[at : at + len(part)])
        at += len(part)
    at = 0
    for part in ints:
        views.append(None if part is None else as_int[at : at + len(part)])
        at += 0 if part is None else len(part)
    input_ids, positions, slot_mapping, logits_indices, seq_lens, starts, lora_slots = views
    return BatchMetadata(
        input_ids=input_ids,
        positions=positions,
        slot_mapping=slot_mapping,
        block_tables=as_int[at:].view(len(tables), width),
        seq_lens=seq_lens,
        query_start_loc=starts,
        logits_indices=logits_indices,
        lora_slots=lora_slots,
    )


class ModelRunner:
    def __init__(self, args: EngineArgs):
        self.device = args.resolve_device()
        checkpoint_dtype = getattr(AutoConfig.from_pretrained(args.model), "dtype", None)
        self.dtype = args.resolve_dtype(self.device, checkpoint_dtype)
        self.model, self.hf_config = load_model(
            args.model, dtype=self.dtype, device=self.device, fused=args.fused_layer_kernels
        )
        self.block_size = args.block_size
        self.num_blocks = self._num_blocks(args)
        shape = self.model.kv_cache_shape(self.num_blocks, self.block_size)
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=self.dtype, device=self.device),
                torch.zeros(shape, dtype=self.dtype, device=self.device),
            )
            for _ in range(self.model.num_layers)
        ]
        logger.info(
            "KV cache: %d blocks of %d tokens (%.1f MiB)",
            self.num_blocks,
            self.block_size,
            self.num_blocks * self._block_bytes() / 2**20,
        )
        self.graphs: DecodeGraphs | None = None

    def capture_graphs(self, args: EngineArgs, lora=None) -> None:
        """Capture decode CUDA graphs unless ``enforce_eager`` (or off CUDA); ``lora``:
        (LoRAStep, max_loras, max_lora_rank) once the LoRA layers are attached."""
        if args.enforce_eager:
            return
        if self.device.type != "cuda":
            logger.debug("CUDA graphs need a CUDA device; running eagerly on %s", self.device)
            return
        max_blocks = -(-self.max_model_len // self.block_size)
        sizes = capture_sizes(args.cuda_graph_sizes, args.max_num_seqs)
        graphs = DecodeGraphs(self._forward, sizes, max_blocks, self.device, lora)
        with torch.inference_mode():
            graphs.capture()
        self.graphs = graphs

    def _block_bytes(self) -> int:
        per_layer = math.prod(self.model.kv_cache_shape(1, self.block_size))  # K or V
        return 2 * self.model.num_layers * per_layer * torch.finfo(self.dtype).bits // 8

    def _num_blocks(self, args: EngineArgs) -> int:
        if args.num_kv_blocks is not None:
            return args.num_kv_blocks
        budget = args.kv_cache_memory
        if budget is None and self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            itemsize = torch.finfo(self.dtype).bits // 8
            reserve = activation_reserve(
                self.model.args, args.max_num_batched_tokens, args.max_num_seqs, itemsize
            )
            budget = kv_cache_budget(free, total, args.gpu_memory_utilization, reserve)
        if budget is None:
            budget = DEFAULT_CPU_KV_CACHE_BYTES
        num_blocks = budget // self._block_bytes()
        if num_blocks < 1:
            raise ValueError(
                f"KV cache budget of {budget} bytes holds no block of {self._block_bytes()} bytes"
            )
        return num_blocks

    @property
    def max_model_len(self) -> int:
        return self.model.max_model_len

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], device=self.device)
        dst = torch.tensor([d for _, d in pairs], device=self.device)
        for key_cache, value_cache in self.kv_caches:
            key_cache[dst] = key_cache[src]
            value_cache[dst] = value_cache[src]

    def prepare(
        self, out: SchedulerOutput, block_manager: BlockManager, lora_slot_of=None
    ) -> tuple[BatchMetadata, list[LogitsRows]]:
        """Pack the scheduled tokens into one flat batch.

        ``lora_slot_of(seq) -> int`` gives each sequence's adapter slot (-1 base);
        None means no adapters in this engine. Every field travels in one int64
        host buffer (pinned on CUDA) with one non-blocking copy (``pack_batch``).
        """
        size = block_manager.block_size
        input_ids, positions, slots, lora_slots = [], [], [], []
        seq_lens, starts, tables, logits_indices, layout = [], [0], [], [], []
        uses_lora = False
        for item in out.scheduled:
            seq, begin, num_new = item.seq, item.start, item.num_new_tokens
            end = begin + num_new
            token_ids, table = seq.token_ids, seq.block_table
            first_token = len(input_ids)
            # slots: BlockManager.slot written inline, one method call a token less on
            # the step's host path (benchmarks/host_step.py measures that path)
            if num_new == 1:
                input_ids.append(token_ids[begin])
                positions.append(begin)
                slots.append(table[begin // size] * size + begin % size)
            else:
                input_ids += token_ids[begin:end]
                positions += range(begin, end)
                slots += [table[p // size] * size + p % size for p in range(begin, end)]
            if lora_slot_of is not None:
                lora_slot = lora_slot_of(seq)
                uses_lora = uses_lora or lora_slot >= 0
                lora_slots += [lora_slot] * num_new
            seq_lens.append(end)
            starts.append(first_token + num_new)
            tables.append(table)
            if num_new == 1 and end == len(token_ids) > seq.num_prompt_tokens:
                # decoding: no prompt logprobs left, samples its next token
                num = len(logits_indices)
                layout.append(LogitsRows(item, range(num, num), num))
                logits_indices.append(first_token)
            else:
                layout.append(self._logits_rows(item, first_token, logits_indices))
        batch = pack_batch(
            self.device,
            (input_ids, positions, slots, logits_indices),
            (seq_lens, starts, lora_slots if lora_slot_of else None),
            tables,
        )
        batch.uses_lora = uses_lora
        if not kernels.use_triton(batch.input_ids):  # the CPU attention plans once a step
            batch.attention_plan = kernels.AttentionPlan.build(
                batch.block_tables, batch.seq_lens, batch.query_start_loc, self.block_size
            )
        return batch, layout

    @staticmethod
    def _logits_rows(item: ScheduledSeq, first_token: int, logits_indices: list[int]):
        seq = item.seq
        end = item.start + item.num_new_tokens
        prompt_rows = range(len(logits_indices), len(logits_indices))
        if seq.request.params.prompt_logprobs is not None and seq.request.seqs[0] is seq:
            # position p predicts prompt token p + 1
            last = min(end, seq.num_prompt_tokens - 1)
            count = max(0, last - item.start)
            prompt_rows = range(len(logits_indices), len(logits_indices) + count)
            logits_indices += range(first_token, first_token + count)
        sample_row = None
        if item.samples:
            sample_row = len(logits_indices)
            logits_indices.append(first_token + item.num_new_tokens - 1)
        return LogitsRows(item, prompt_rows, sample_row)

    @torch.inference_mode()
    def execute(self, batch: BatchMetadata) -> torch.Tensor:
        """Forward the batch; returns float32 logits [S, vocab] for ``logits_indices``.

        A decode step replays its CUDA graph when graphs are captured (``cuda_graphs``).
        """
        if self.graphs is not None and self.graphs.can_run(batch, batch.uses_lora):
            return self.graphs.run(batch)
        return self._forward(batch)

    def _forward(self, batch: BatchMetadata) -> torch.Tensor:
        hidden = self.model.forward(batch, self.kv_caches)
        if batch.logits_indices.numel() == 0:
            return hidden.new_empty((0, self.model.vocab_size), dtype=torch.float32)
        return self.model.compute_logits(hidden[batch.logits_indices]).float()
