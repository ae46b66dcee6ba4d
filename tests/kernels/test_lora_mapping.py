"""LoRAMapping: tokens grouped by adapter slot, and the tiles the kernels run over."""

import pytest
import torch

from lorapool.kernels import LoRAMapping, lora_ops


def test_groups_tokens_by_slot_stably_and_leaves_out_base_tokens():
    mapping = LoRAMapping.from_slots([2, -1, 0, 2, -1, 0, 2])
    assert mapping.order.tolist() == [1, 4, 2, 5, 0, 3, 6]
    assert mapping.segments == ((0, 2, 4), (2, 4, 7))
    assert mapping.max_slot == 2 and mapping.num_tokens == 7
    assert mapping.tiles.tolist() == [[2, 4], [4, 7], [0, 2]]
    assert mapping.block_m == 16


def test_long_segments_are_cut_into_tiles_of_block_m():
    mapping = LoRAMapping.from_slots([1] * 150 + [0] * 3)
    assert mapping.block_m == 64
    starts, ends, slots = mapping.tiles.tolist()
    assert starts == [0, 3, 67, 131] and ends == [3, 153, 153, 153]
    assert slots == [0, 1, 1, 1]


def test_tensor_list_and_empty_inputs():
    assert (
        LoRAMapping.from_slots(torch.tensor([3, 1])).segments
        == LoRAMapping.from_slots([3, 1]).segments
    )
    empty = LoRAMapping.from_slots([])
    assert empty.num_tiles == 0 and empty.max_slot == -1
    only_base = LoRAMapping.from_slots([-1, -1])
    assert only_base.num_tiles == 0 and only_base.segments == ()


def test_rejects_slots_below_minus_one():
    with pytest.raises(ValueError, match=">= -1"):
        LoRAMapping.from_slots([0, -2])


def test_split_k_only_when_tiles_leave_the_device_idle():
    cpu = torch.device("cpu")
    assert lora_ops.split_k_factor(1, 12, cpu) == 4
    assert lora_ops.split_k_factor(1, 2, cpu) == 2
    assert lora_ops.split_k_factor(8, 12, cpu) == 1
