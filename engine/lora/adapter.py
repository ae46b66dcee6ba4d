"""Load and validate one PEFT LoRA adapter directory against the base model.

An adapter directory holds ``adapter_config.json`` and
``adapter_model.safetensors``. Pickle weights (``adapter_model.bin``) are
never unpickled. Every rejection raises ``AdapterError`` whose message names
the adapter and the reason.
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors

from lorapool.adapter_config import (
    CONFIG_FILE,
    AdapterIdentity,
    identity_of,
    parse_config,
    refusal,
)
from lorapool.engine.models.llama import PACKED_MODULES
from lorapool.identity import ADAPTER_WEIGHTS, adapter_sha256
from lorapool.protocol import LoRARequest

WEIGHTS_FILE = ADAPTER_WEIGHTS
PICKLE_FILES = ("adapter_model.bin", "adapter_model.pt", "adapter_model.pth")

_PROJECTIONS = {
    "self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "mlp": ("gate_proj", "up_proj", "down_proj"),
}


def _target(block: str, name: str) -> tuple[str, int]:
    """Where the model keeps projection ``name``: its own packing (PACKED_MODULES);
    a projection it does not pack is slice 0 of a module of that name."""
    module, index = PACKED_MODULES.get(name, (name, 0))
    return f"{block}.{module}", index


# PEFT module name -> (our module, slice index in the packed projection)
TARGETS = {name: _target(block, name) for block, names in _PROJECTIONS.items() for name in names}
_KEY = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$"
)


class AdapterError(ValueError):
    """An adapter cannot be used; the message names it and says why."""

    field = "adapter"  # what a request it fails is refused for, as a FieldError's path

    def __init__(self, lora_request: LoRARequest, reason: str):
        self.lora_request = lora_request
        self.reason = reason
        super().__init__(
            f"adapter {lora_request.lora_name!r} (id {lora_request.lora_int_id}, "
            f"path {lora_request.lora_path!r}): {reason}"
        )


@dataclass
class LoRAAdapter:
    """A validated adapter in CPU memory, scaling not yet applied; ``identity`` is that
    of the bytes it was parsed from (config and weights, each read once)."""

    lora_request: LoRARequest
    path: str  # resolved
    rank: int
    lora_alpha: float
    use_rslora: bool
    identity: AdapterIdentity
    # (layer, PEFT module name) -> (A [r, in], B [out, r]), float32 on the CPU
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(repr=False)

    @property
    def sha256(self) -> str:
        return self.identity.sha256

    @property
    def scaling(self) -> float:
        return self.lora_alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)

    @property
    def target_modules(self) -> list[str]:
        return sorted({name for _, name in self.weights})


@dataclass(frozen=True)
class ModelShapes:
    """What an adapter is validated against: layer count and (in, out) per PEFT module."""

    num_layers: int
    shapes: dict[str, tuple[int, int]]

    @classmethod
    def of(cls, model) -> ModelShapes:
        layer = model.model.layers[0]
        shapes = {}
        for name, (module_name, index) in TARGETS.items():
            module = layer.get_submodule(module_name)
            shapes[name] = (module.in_features, module.output_sizes[index])
        return cls(len(model.model.layers), shapes)


def load_adapter(
    lora_request: LoRARequest,
    model: ModelShapes,
    max_rank: int,
    adapter_roots: list[str] | None = None,
) -> LoRAAdapter:
    """Read, validate and return the adapter at ``lora_request.lora_path``.

    Each file is read once and its hash taken over the bytes parsed, so the identity
    is that of what runs, whatever is written to the folder meanwhile."""
    path = resolve_path(lora_request, adapter_roots or [])
    config = _read_config(lora_request, path)
    rank = _check_config(lora_request, config, max_rank)
    raw = _read_bytes(lora_request, path / WEIGHTS_FILE)
    identity = identity_of(config, hashlib.sha256(raw).hexdigest())
    weights = _read_weights(lora_request, raw)
    pairs = _pair_weights(lora_request, weights, model, rank)
    _check_layers(lora_request, config, pairs)
    return LoRAAdapter(
        lora_request,
        str(path),
        rank,
        identity.alpha,
        bool(config.get("use_rslora", False)),
        identity,
        pairs,
    )


def read_identity(lora_request: LoRARequest, adapter_roots: list[str]) -> AdapterIdentity:
    """The identity of the adapter's files as they are now, without loading it."""
    path = resolve_path(lora_request, adapter_roots)
    config = _read_config(lora_request, path)
    return identity_of(config, adapter_sha256(path))


def resolve_path(lora_request: LoRARequest, adapter_roots: list[str]) -> Path:
    """The real directory of the adapter; inside one of ``adapter_roots`` when any are set."""
    if not lora_request.lora_path:
        raise AdapterError(lora_request, "no adapter path given")
    path = Path(lora_request.lora_path).expanduser().resolve()  # follows symlinks and ..
    if adapter_roots:
        roots = [Path(r).expanduser().resolve() for r in adapter_roots]
        if not any(path == root or path.is_relative_to(root) for root in roots):
            raise AdapterError(
                lora_request,
                f"path resolves to {path}, outside the allowed "
                f"adapter_roots {[str(r) for r in roots]}",
            )
    if not path.is_dir():
        raise AdapterError(lora_request, f"adapter directory {path} does not exist")
    if not (path / WEIGHTS_FILE).is_file():
        if any((path / name).exists() for name in PICKLE_FILES):
            raise AdapterError(
                lora_request,
                f"only pickle weights in {path}; they are never "
                f"loaded: convert them to {WEIGHTS_FILE}",
            )
        raise AdapterError(lora_request, f"missing {WEIGHTS_FILE} in {path}")
    return path


def _read_bytes(lora_request: LoRARequest, file: Path) -> bytes:
    try:
        return file.read_bytes()
    except OSError as e:
        raise AdapterError(lora_request, f"cannot read {file.name}: {e}") from None


def _read_config(lora_request: LoRARequest, path: Path) -> dict:
    file = path / CONFIG_FILE
    if not file.is_file():
        raise AdapterError(lora_request, f"missing {CONFIG_FILE} in {path}")
    try:
        return parse_config(_read_bytes(lora_request, file))
    except ValueError as e:
        raise AdapterError(lora_request, str(e)) from None


def _check_config(lora_request: LoRARequest, config: dict, max_rank: int) -> int:
    reason = refusal(config)
    if reason is not None:
        raise AdapterError(lora_request, reason)
    _check_targets(lora_request, config.get("target_modules"))
    alpha = config.get("lora_alpha", 8)
    if not isinstance(alpha, int | float) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise AdapterError(lora_request, f"lora_alpha={alpha!r} must be a finite number")
    rank = config.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise AdapterError(lora_request, f"rank r={rank!r} must be a positive int")
    if rank > max_rank:
        raise AdapterError(lora_request, f"rank {rank} exceeds max_lora_rank={max_rank}")
    return rank


def _check_targets(lora_request: LoRARequest, targets) -> None:
    names = [targets] if isinstance(targets, str) else list(targets or [])
    unknown = sorted(str(n) for n in names if n not in TARGETS)
    if unknown or not names:
        raise AdapterError(
            lora_request,
            f"unknown target modules {unknown or names}: supported are {sorted(TARGETS)}",
        )


def _read_weights(lora_request: LoRARequest, raw: bytes) -> dict[str, torch.Tensor]:
    try:
        return load_safetensors(raw)
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise AdapterError(lora_request, f"corrupt safetensors file {WEIGHTS_FILE}: {e}") from None


def _check_layers(lora_request: LoRARequest, config: dict, pairs: dict) -> None:
    """PEFT puts LoRA only on ``target_modules`` of ``layers_to_transform``: weights for
    any other module would not run there, so they are refused here, not run."""
    targets = config["target_modules"]
    targets = {targets} if isinstance(targets, str) else set(targets)
    layers = config.get("layers_to_transform")
    layers = [layers] if isinstance(layers, int) else layers
    for layer, name in sorted(pairs):
        if name not in targets or (layers is not None and layer not in layers):
            raise AdapterError(
                lora_request,
                f"weights for layer {layer} {name}, which the config does not target "
                f"(target_modules={config['target_modules']!r}, layers_to_transform={layers!r})",
            )


def _pair_weights(lora_request, weights, model: ModelShapes, rank: int):
    """(layer, module) -> (A, B) checked against the base model's shapes."""
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in weights.items():
        match = _KEY.match(key)
        if match is None or match.group(3) not in TARGETS:
            raise AdapterError(
                lora_request,
                f"unsupported weight {key!r} (only lora_A/lora_B "
                f"of {sorted(TARGETS)} are supported)",
            )
        layer, name, kind = int(match.group(1)), match.group(3), match.group(4)
        if layer >= model.num_layers:
            raise AdapterError(
                lora_request,
                f"weight {key!r} names layer {layer}; the base model has {model.num_layers} layers",
            )
        found.setdefault((layer, name), {})[kind] = tensor
    if not found:
        raise AdapterError(lora_request, f"{WEIGHTS_FILE} holds no LoRA weights")
    return {k: _check_pair(lora_request, k, ab, model, rank) for k, ab in found.items()}


def _check_pair(lora_request, key, ab, model: ModelShapes, rank: int):
    layer, name = key
    if set(ab) != {"A", "B"}:
        raise AdapterError(
            lora_request, f"layer {layer} {name} lacks lora_{({'A', 'B'} - set(ab)).pop()}"
        )
    in_features, out_features = model.shapes[name]
    a, b = ab["A"], ab["B"]
    expected_a, expected_b = (rank, in_features), (out_features, rank)
    if tuple(a.shape) != expected_a or tuple(b.shape) != expected_b:
        raise AdapterError(
            lora_request,
            f"layer {layer} {name}: shapes A {tuple(a.shape)}, "
            f"B {tuple(b.shape)} do not fit the base model "
            f"(expected A {expected_a}, B {expected_b})",
        )
    for kind, tensor in (("A", a), ("B", b)):
        if not torch.isfinite(tensor).all():
            raise AdapterError(
                lora_request,
                f"layer {layer} {name} lora_{kind} holds {_non_finite(tensor)}; "
                "the weights must be finite",
            )
    return a.float(), b.float()


def _non_finite(tensor: torch.Tensor) -> str:
    counts = {
        "NaN": int(tensor.isnan().sum()),
        "+Inf": int(tensor.isposinf().sum()),
        "-Inf": int(tensor.isneginf().sum()),
    }
    return ", ".join(f"{n} {what}" for what, n in counts.items() if n)
