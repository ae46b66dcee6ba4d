"""Which ops of a piece of torch code read device values back to the host: on a GPU
each one makes the host wait for the device (a sync). Counted on the CPU by a dispatch
mode: a scalar read (``.item()``, ``bool(t)``, ``int(t)``), an op whose output's shape
depends on the values (``nonzero``, ``masked_select``, ``unique``), and an index or
index_put with a boolean mask (it runs ``nonzero``)."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
READS = {
    aten._local_scalar_dense.default,
    aten.is_nonzero.default,
    aten.equal.default,
    aten.nonzero.default,
    aten.masked_select.default,
    aten._unique2.default,
    aten.unique_consecutive.default,
    aten.unique_dim.default,
}
INDEXING = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default}
MASKS = (torch.bool, torch.uint8)


class HostReads(TorchDispatchMode):
    """``with HostReads() as reads: ...``; ``reads.ops``: the reading ops, in order."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in READS or (func in INDEXING and _masked(args[1])):
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _masked(indices) -> bool:
    return any(isinstance(i, torch.Tensor) and i.dtype in MASKS for i in indices)
