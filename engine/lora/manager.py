"""Adapters in two cache levels: a CPU LRU of loaded adapters and the device slots.

- CPU: up to ``max_cpu_loras`` validated adapters (weights in float32), least
  recently used dropped first; a dropped adapter is read from disk again when
  next needed, and must still have the same weights (sha256).
- Device: ``max_loras`` slots of stacked A/B buffers per targeted projection
  (see ``layers.LoRALayer``). ``activate`` gives every adapter of a step a
  slot, evicting the least recently used adapter that the step does not use.
- Pinned adapters (at most ``max_cpu_loras``) never leave the CPU cache, and
  keep their device slot unless a step needs it for one of its own adapters
  and no unpinned adapter can make room: a step of at most ``max_loras``
  adapters (the scheduler's limit) therefore always gets its slots.

The registry remembers each adapter id's path and identity (weights and config
hashes, ``adapter_config.AdapterIdentity``) for the life of the engine (until
``remove_lora``): an id reused with another path, other weights or another config
is refused, and so is a load whose files differ from what ``expect`` was told (the
pool's registry record).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

import torch

from lorapool.adapter_config import AdapterIdentity, changes
from lorapool.engine.config import EngineArgs
from lorapool.engine.lora.adapter import (
    TARGETS,
    AdapterError,
    LoRAAdapter,
    ModelShapes,
    load_adapter,
    read_identity,
    resolve_path,
)
from lorapool.engine.lora.layers import LoRALayer, LoRAStep, stage
from lorapool.kernels import LoRAMapping
from lorapool.protocol import LoRARequest

logger = logging.getLogger(__name__)


AdapterKey = tuple[int, str]


def adapter_key(lora_request: LoRARequest) -> AdapterKey:
    """What a request names: the adapter id and the path it gave for it."""
    return lora_request.lora_int_id, lora_request.lora_path


class LoRAManager:
    def __init__(self, model, args: EngineArgs, device: torch.device, dtype: torch.dtype):
        self.max_loras, self.max_rank = args.max_loras, args.max_lora_rank
        self.max_cpu_loras = args.max_cpu_loras
        self.adapter_roots = list(args.adapter_roots)
        self.shapes = ModelShapes.of(model)
        self.step = LoRAStep(args.lora_live_work)
        self.lora_dtype = args.resolve_lora_dtype(dtype)
        self.layers = _attach_layers(model, args, device, self.lora_dtype, self.step)
        # adapters of the CPU cache as the slots hold them, in pinned memory on CUDA, so
        # that a swap into a slot is a few asynchronous copies (built at first use)
        self.pin = device.type == "cuda"
        self.staged: dict[int, dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]] = {}
        self.cpu: OrderedDict[int, LoRAAdapter] = OrderedDict()
        self.registry: dict[int, tuple[str, AdapterIdentity]] = {}  # id -> (resolved path, …)
        self.expected: dict[int, Any] = {}  # id -> the identity it must have (the pool's)
        self.checked: dict[int, Any] = {}  # id -> the identity ``check`` read, not loaded
        self.raw_paths: dict[int, str] = {}  # id -> the lora_path it was loaded from
        self.slots: list[int | None] = [None] * self.max_loras
        self.slot_lru: OrderedDict[int, None] = OrderedDict()  # ids in slots, oldest first
        self.slot_ranks: dict[int, int] = {}
        self.pinned: set[int] = set()

    # --- engine API -------------------------------------------------------
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load (and validate) into the CPU cache; raises AdapterError. True if newly loaded."""
        if lora_request.lora_int_id in self.cpu:
            self._check_same_path(lora_request)
            self.cpu.move_to_end(lora_request.lora_int_id)
            return False
        self._load(lora_request)
        return True

    def remove_lora(self, lora_id: int) -> bool:
        """Forget the adapter everywhere (slot, CPU cache, pin, registry)."""
        known = lora_id in self.registry or lora_id in self.cpu
        self._evict_slot(lora_id)
        self.cpu.pop(lora_id, None)
        self.pinned.discard(lora_id)
        self.staged.pop(lora_id, None)
        self.registry.pop(lora_id, None)
        self.raw_paths.pop(lora_id, None)
        self.checked.pop(lora_id, None)
        return known

    def pin_lora(self, lora_id: int) -> bool:
        """Keep a loaded adapter in the CPU cache and, in preference, in its device slot."""
        if len(self.pinned | {lora_id}) > self.max_cpu_loras:
            raise ValueError(
                f"pinning adapter {lora_id} would pin more than "
                f"max_cpu_loras={self.max_cpu_loras} adapters"
            )
        if lora_id not in self.cpu:
            raise ValueError(f"adapter id {lora_id} is not loaded: add_lora it first")
        self.pinned.add(lora_id)
        return True

    def list_loras(self) -> set[int]:
        """Ids of the adapters loaded in the CPU cache."""
        return set(self.cpu)

    def get_adapter(self, lora_id: int) -> LoRAAdapter | None:
        return self.cpu.get(lora_id)

    # --- per step ---------------------------------------------------------
    def activate(self, lora_requests: Iterable[LoRARequest]) -> dict[AdapterKey, AdapterError]:
        """Give each adapter a device slot; returns the errors of those that failed.

        Errors are keyed by (lora_int_id, lora_path): LoRARequests compare by id
        alone, so two requests naming one id with two paths are two keys here,
        and the second is refused without failing the first.
        """
        requests = {adapter_key(r): r for r in lora_requests}
        in_step = {r.lora_int_id for r in requests.values()}
        errors: dict[AdapterKey, AdapterError] = {}
        for key, request in requests.items():
            try:
                self._activate_one(request, in_step)
            except AdapterError as e:
                errors[key] = e
                logger.warning("%s", e)
        return errors

    def slot_of(self, seq) -> int:
        """The device slot of a sequence's adapter; -1 for the base model."""
        lora_id = seq.lora_int_id
        if lora_id == 0:
            return -1
        return self.slots.index(lora_id)

    def set_step_for(self, scheduled, device: torch.device) -> None:
        """``set_step`` for a SchedulerOutput, tokens in the order ``prepare`` packs them."""
        slots = []
        for item in scheduled.scheduled:
            slots += [self.slot_of(item.seq)] * item.num_new_tokens
        self.set_step(slots, device)

    def set_step(self, slots: list[int], device: torch.device) -> None:
        """Set the token -> slot mapping every LoRA layer uses in the next forward."""
        used = {self.slots[s] for s in set(slots) if s >= 0}
        mapping = LoRAMapping.from_slots(slots, device) if used else None
        # pad to the largest rank of this step's adapters, not of every resident one
        self.step.set(mapping, max((self.slot_ranks[i] for i in used), default=0))

    # --- internals --------------------------------------------------------
    def _activate_one(self, request: LoRARequest, in_step: set[int]) -> None:
        lora_id = request.lora_int_id
        if lora_id in self.slot_lru:
            self._check_same_path(request)
            self.slot_lru.move_to_end(lora_id)
            if lora_id in self.cpu:
                self.cpu.move_to_end(lora_id)
            return
        adapter = self.cpu.get(lora_id)
        if adapter is None:
            adapter = self._load(request)
        else:
            self._check_same_path(request)
            self.cpu.move_to_end(lora_id)
        self._write_slot(self._free_slot(request, in_step), adapter)

    def _load(self, request: LoRARequest) -> LoRAAdapter:
        adapter = load_adapter(request, self.shapes, self.max_rank, self.adapter_roots)
        expected = self.expected.get(request.lora_int_id)
        _refuse_changes(request, changes(expected, adapter.identity) if expected else [])
        known = self.registry.get(request.lora_int_id)
        if known is not None and known[0] != adapter.path:
            raise AdapterError(
                request,
                f"adapter id {request.lora_int_id} is already registered with path {known[0]}",
            )
        if known is not None and known[1] != adapter.identity:
            since = f"adapter id {request.lora_int_id} was loaded"
            raise AdapterError(request, "; ".join(changes(known[1], adapter.identity, since)))
        self.registry[request.lora_int_id] = (adapter.path, adapter.identity)
        self.raw_paths[request.lora_int_id] = request.lora_path
        self.cpu[request.lora_int_id] = adapter
        self._trim_cpu()
        return adapter

    def expect(self, request: LoRARequest, registered: Any) -> None:
        """Refuse to load ``request``'s adapter unless its files are ``registered``'s
        (an ``AdapterIdentity`` or a registry record: weights sha256, and config sha256
        or, for a record written before config hashes, rank, alpha and targets).

        Raises AdapterError at once when it is already loaded otherwise (its id was
        registered again with new files: ``remove_lora`` it first).
        """
        loaded = self.registry.get(request.lora_int_id)
        changed = changes(registered, loaded[1], "registration") if loaded is not None else []
        if changed:
            raise AdapterError(
                request,
                f"adapter id {request.lora_int_id} is loaded with other files than the "
                "registered ones: " + "; ".join(changed),
            )
        self.expected[request.lora_int_id] = registered

    def check(self, request: LoRARequest, registered: Any) -> AdapterIdentity:
        """``expect`` ``registered`` and check the adapter's files now; their identity.

        Loaded into the CPU cache when that evicts no other adapter (or already there);
        else its files are read and hashed, not kept, and its later load must have
        exactly this identity. Raises AdapterError naming what changed.
        """
        self.expect(request, registered)
        lora_id = request.lora_int_id
        if lora_id in self.cpu or len(self.cpu) < self.max_cpu_loras:
            self.add_lora(request)
            return self.registry[lora_id][1]
        if lora_id in self.registry:  # loaded before: a reload must match that
            return self.registry[lora_id][1]
        identity = self.checked.get(lora_id)
        if identity is None:  # read once per adapter: its load must match it anyway
            identity = self.checked[lora_id] = read_identity(request, self.adapter_roots)
        _refuse_changes(request, changes(registered, identity))
        self.expected[lora_id] = identity
        return identity

    def identity(self, lora_id: int) -> AdapterIdentity | None:
        """The identity of adapter ``lora_id`` as loaded (None: not loaded yet)."""
        known = self.registry.get(lora_id)
        return known[1] if known is not None else None

    def _check_same_path(self, request: LoRARequest) -> None:
        known = self.registry[request.lora_int_id][0]
        if self.raw_paths.get(request.lora_int_id) == request.lora_path:
            return
        path = str(resolve_path(request, self.adapter_roots))
        if path != known:
            raise AdapterError(
                request, f"adapter id {request.lora_int_id} is already registered with path {known}"
            )

    def _trim_cpu(self) -> None:
        for lora_id in list(self.cpu):
            if len(self.cpu) <= self.max_cpu_loras:
                return
            if lora_id not in self.pinned and lora_id not in self.slot_lru:
                del self.cpu[lora_id]
                self.staged.pop(lora_id, None)

    def _free_slot(self, request: LoRARequest, in_step: set[int]) -> int:
        if None in self.slots:
            return self.slots.index(None)
        # least recently used first, unpinned before pinned
        candidates = sorted(
            (i for i in self.slot_lru if i not in in_step), key=lambda i: i in self.pinned
        )
        if not candidates:
            raise AdapterError(
                request,
                f"no free device slot: the step uses more than max_loras={self.max_loras} adapters",
            )
        slot = self.slots.index(candidates[0])
        self._evict_slot(candidates[0])
        return slot

    def _evict_slot(self, lora_id: int) -> None:
        if lora_id not in self.slot_lru:
            return
        slot = self.slots.index(lora_id)
        for layer in self.layers.values():
            layer.clear_slot(slot)
        self.slots[slot] = None
        del self.slot_lru[lora_id]
        self.slot_ranks.pop(lora_id, None)
        self._trim_cpu()

    def _write_slot(self, slot: int, adapter: LoRAAdapter) -> None:
        lora_id = adapter.lora_request.lora_int_id
        for layer in self.layers.values():
            layer.clear_slot(slot)
        for (layer_idx, name), (a, b_t) in self._staged(adapter).items():
            module_name, index = TARGETS[name]
            self.layers[(layer_idx, module_name)].write_staged(slot, index, a, b_t)
        self.slots[slot] = lora_id
        self.slot_lru[lora_id] = None
        self.slot_ranks[lora_id] = adapter.rank

    def _staged(self, adapter: LoRAAdapter):
        lora_id = adapter.lora_request.lora_int_id
        staged = self.staged.get(lora_id)
        if staged is None:
            staged = {
                key: stage(a, b, adapter.scaling, self.lora_dtype, self.pin)
                for key, (a, b) in adapter.weights.items()
            }
            if lora_id in self.cpu:  # kept while the adapter is
                self.staged[lora_id] = staged
        return staged


def _refuse_changes(request: LoRARequest, changed: list[str]) -> None:
    if changed:
        raise AdapterError(
            request, "; ".join(changed) + "; register the new version under a new name"
        )


def _attach_layers(model, args: EngineArgs, device, dtype, step: LoRAStep):
    """A LoRALayer on every projection an adapter may target, hooked into the model."""
    layers = {}
    module_names = sorted({module for module, _ in TARGETS.values()})
    for i, decoder_layer in enumerate(model.model.layers):
        for name in module_names:
            linear = decoder_layer.get_submodule(name)
            linear.lora = LoRALayer(
                linear.in_features,
                linear.output_sizes,
                args.max_loras,
                args.max_lora_rank,
                dtype,
                device,
                step,
            )
            layers[(i, name)] = linear.lora
    return layers
