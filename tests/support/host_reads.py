"""Which ops of a piece of torch code read device values back to the host: on a GPU
each one makes the host wait for the device (a sync). Counted on the CPU by a dispatch
mode that follows the values computed from the tensors it is given (the step's logits:
on a GPU, device values) through every op, and records a read of one of them: a scalar
read (``.item()``, ``bool(t)``, ``int(t)``), an op whose output's shape depends on the
values (``nonzero``, ``masked_select``, ``unique``), an index or index_put with a
boolean mask (it runs ``nonzero``). Tensors built from host values (token lists,
parameters) are not followed: reading those costs no sync on a GPU either."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

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


class _Tensors:
    """A set of tensors by identity, each kept alive while the set is (so that no id is
    reused by a tensor the set does not hold)."""

    def __init__(self, tensors=()):
        self._held = {id(t): t for t in tensors}

    def __contains__(self, tensor) -> bool:
        return id(tensor) in self._held

    def add(self, tensor) -> None:
        self._held[id(tensor)] = tensor

    def update(self, tensors) -> None:
        for tensor in tensors:
            self.add(tensor)


class HostReads(TorchDispatchMode):
    """``with HostReads(logits, ...) as reads: ...``; ``reads.ops``: the reading ops of
    values computed from those tensors, in order."""

    def __init__(self, *device_tensors: torch.Tensor):
        super().__init__()
        self.ops: list[str] = []
        self.device = _Tensors(t for t in device_tensors if t is not None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if func in READS and any(t in self.device for t in inputs):
            self.ops.append(str(func))
        if func in INDEXING and any(self._device_mask(i) for i in args[1]):
            self.ops.append(str(func))
        out = func(*args, **kwargs)
        if any(t in self.device for t in inputs):  # the values flow on: outputs, writes
            self.device.update(t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))
            for arg, value in zip(func._schema.arguments, args):
                written = arg.alias_info is not None and arg.alias_info.is_write
                if written and isinstance(value, torch.Tensor):
                    self.device.add(value)
        return out

    def _device_mask(self, index) -> bool:
        return isinstance(index, torch.Tensor) and index.dtype in MASKS and index in self.device
