"""Host values (row indices, per-row parameters, uniforms) as device tensors, without
the host waiting for the device.

``torch.tensor(values, device="cuda")`` and ``cpu_tensor.to("cuda")`` copy from pageable
memory, which makes the host wait until every kernel already queued on the stream has
run: a sampler that builds a few such tensors after the forward waits for the forward,
then launches its kernels one by one while the device idles, and waits again at each.
``to_device`` stages the values in pinned memory (torch's caching host allocator, which
keeps the block until the copy's stream event has passed) and copies without blocking,
in stream order: the host runs ahead and waits once, at the step's read of its tokens.
On other devices (the CPU) it is ``torch.tensor`` / ``Tensor.to``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(
    values: Sequence | torch.Tensor, device: torch.device, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """``values`` (a list, or a CPU tensor) as a tensor of ``dtype`` on ``device``."""
    cuda = device.type == "cuda"
    if isinstance(values, torch.Tensor):
        host = values if dtype is None else values.to(dtype)
        if not cuda:
            return host.to(device)
        return (host if host.is_pinned() else host.pin_memory()).to(device, non_blocking=True)
    if not cuda:
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


class ReadBack:
    """A device tensor's copy to the host, started when made: ``tolist`` waits for that
    copy alone, not for work queued on the device after it (``.tolist()`` on a CUDA
    tensor copies from pageable memory in stream order, so it would wait for the next
    step's forward too). On CUDA: a non-blocking copy into pinned memory and an event
    recorded after it; elsewhere the tensor itself (the CPU ran it already)."""

    __slots__ = ("host", "event")

    def __init__(self, tensor: torch.Tensor):
        self.event = None
        if tensor.device.type != "cuda":
            self.host = tensor
            return
        self.host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        self.host.copy_(tensor, non_blocking=True)
        self.event = torch.cuda.Event()
        self.event.record()

    def tolist(self) -> list:
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()
