"""``engine.host_copy.to_device``: the values, dtype and device asked for, from a list or a
CPU tensor. On a CUDA device it also must not wait for queued kernels (checked by
``bench gpu``'s throughput section, ``decode_step.host_copy_check``, and below when a
GPU is here)."""

import time

import pytest
import torch

from lorapool.engine.host_copy import to_device


@pytest.mark.parametrize("dtype", [torch.long, torch.float32, torch.float64, None])
def test_a_list_arrives_with_its_values_and_dtype(dtype):
    values = [3, 0, 7, 1]
    got = to_device(values, torch.device("cpu"), dtype)
    assert got.tolist() == values and got.device.type == "cpu"
    assert got.dtype == (dtype or torch.tensor(values).dtype)


def test_a_cpu_tensor_arrives_converted_and_the_source_is_untouched():
    source = torch.tensor([True, False, True])
    got = to_device(source, torch.device("cpu"), torch.long)
    assert got.tolist() == [1, 0, 1] and got.dtype == torch.long
    assert source.dtype == torch.bool


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_copy_does_not_wait_for_queued_kernels():
    device = torch.device("cuda")
    to_device([1], device, torch.long)  # the pinned pool's first block
    torch.cuda.synchronize()
    torch.cuda._sleep(10**9)  # far longer than a host copy
    began = time.perf_counter()
    got = to_device(list(range(64)), device, torch.long)
    waited = time.perf_counter() - began
    assert got.tolist() == list(range(64))
    assert waited < 0.05
