"""How the CPU attention runs a step: built once, read by every layer.

The CPU path of ``paged_attention`` (``reference``) gathers each sequence's
context from the paged cache. Which blocks to gather, how decode rows group,
and the masks are the same for every layer of a step, so the model runner
builds this plan once per step (``BatchMetadata.attention_plan``) instead of
each of the model's layers rebuilding it from the block tables.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# A decode group pads every context to its longest; a context shorter than this
# share of the longest starts a group of its own.
GROUP_MIN_SHARE = 0.8


@dataclass(frozen=True)
class DecodeGroup:
    """Decode rows (one new token each) gathered and attended together.

    Attributes:
        tokens: [n] int64, the query row of each sequence in the batch.
        blocks: [n * num_blocks] int64, each sequence's cache blocks, padded
            with block 0 (padding only feeds masked positions).
        num_blocks: blocks gathered per sequence (the group's longest).
        valid: [n, num_blocks * block_size] bool, positions inside each context.
    """

    tokens: torch.Tensor
    blocks: torch.Tensor
    num_blocks: int
    valid: torch.Tensor


@dataclass(frozen=True)
class PrefillSeq:
    """A sequence with more than one new token: rows start:end of the batch."""

    start: int
    end: int
    length: int  # context length, the new tokens included
    blocks: torch.Tensor  # [ceil(length / block_size)] int64


@dataclass(frozen=True)
class AttentionPlan:
    block_size: int
    decode: tuple[DecodeGroup, ...]
    prefill: tuple[PrefillSeq, ...]

    @classmethod
    def build(
        cls,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        block_size: int,
    ) -> AttentionPlan:
        """The plan of a batch (arguments as in ``reference.paged_attention``)."""
        starts, lens = query_start_loc.tolist(), seq_lens.tolist()
        q_lens = [starts[b + 1] - starts[b] for b in range(len(lens))]
        tables = block_tables.long().clamp(min=0)  # -1 padding of a table only feeds masks
        decode = [b for b, n in enumerate(q_lens) if n == 1]
        groups = tuple(
            _decode_group(rows, tables, starts, lens, block_size)
            for rows in length_groups(decode, lens, block_size)
        )
        prefill = tuple(
            PrefillSeq(starts[b], starts[b + 1], lens[b], tables[b, : -(-lens[b] // block_size)])
            for b, n in enumerate(q_lens)
            if n > 1
        )
        return cls(block_size, groups, prefill)


def length_groups(rows: list[int], lens: list[int], block_size: int) -> list[list[int]]:
    """Decode rows in groups of similar context length, longest first.

    Each group is gathered and padded to its longest context; a row joins the
    current group while its context needs more than ``GROUP_MIN_SHARE`` of
    the group's blocks, so padding is at most a fifth of what a group gathers.
    One group padded to the batch's longest context gathers about twice the
    real contexts when lengths are spread evenly: a SmolLM2 decode step of 64
    sequences (prompts of 16 to 512 tokens) takes 321 ms grouped against 415 ms
    as one group (benchmarks/RESULTS.md, "CPU engine"). A lower share
    pads more, a higher one makes more, smaller calls.
    """
    groups: list[list[int]] = []
    longest = 0
    for b in sorted(rows, key=lambda b: -lens[b]):
        num_blocks = -(-lens[b] // block_size)
        if not groups or num_blocks <= GROUP_MIN_SHARE * longest:
            groups.append([])
            longest = num_blocks
        groups[-1].append(b)
    return groups


def _decode_group(rows, tables: torch.Tensor, starts, lens, block_size: int) -> DecodeGroup:
    device = tables.device
    idx = torch.tensor(rows, device=device)
    num_blocks = -(-lens[rows[0]] // block_size)  # rows come longest first
    group_lens = torch.tensor([lens[b] for b in rows], device=device)
    positions = torch.arange(num_blocks * block_size, device=device)
    return DecodeGroup(
        tokens=torch.tensor([starts[b] for b in rows], device=device),
        blocks=tables[idx, :num_blocks].reshape(-1),
        num_blocks=num_blocks,
        valid=positions[None, :] < group_lens[:, None],
    )
