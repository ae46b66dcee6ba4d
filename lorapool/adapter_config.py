"""What an adapter *is*: its weights and the part of its ``adapter_config.json`` that
changes what it computes. Torch-free (the registry reads it; the engine's loader too).

An adapter's identity (:class:`AdapterIdentity`) is

- ``sha256``: of ``adapter_model.safetensors`` (``identity.adapter_sha256``);
- ``config_sha256``: of the canonical JSON of its config's math fields
  (:func:`canonical_config`: PEFT ``LoraConfig``'s fields that change the product,
  defaults filled in, numbers and lists normalised, nothing else);
- ``digest``: of both, in a domain of its own: the one value that says "this adapter
  version", which the registry records, the worker checks against what it loaded
  and every audit row carries.

Editing ``lora_alpha`` (or ``r``, ``use_rslora``, the targets, ...) changes
``config_sha256`` and so ``digest``; editing ``lora_dropout`` or ``task_type`` (training
and metadata) changes neither. :func:`refusal` names a config the loader cannot run as
PEFT would (DoRA, patterns, a field it does not know set to a value), so that no field is
silently ignored.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

CONFIG_FILE = "adapter_config.json"
CONFIG_DOMAIN = b"lorapool adapter config v1\n"
DIGEST_DOMAIN = b"lorapool adapter v1\n"

# LoraConfig fields (PEFT 0.21) the loader runs, with PEFT's defaults. fan_in_fan_out
# is for Conv1D layers; PEFT turns it off for nn.Linear, which is all the loader targets.
SUPPORTED: dict[str, Any] = {
    "peft_type": "LORA",
    "r": 8,
    "lora_alpha": 8,
    "use_rslora": False,
    "target_modules": None,
    "bias": "none",
    "fan_in_fan_out": False,
    "layers_to_transform": None,
    "layers_pattern": None,
}
# Fields that change the math in ways the loader does not run: refused when set.
REFUSED = {
    "use_dora": "DoRA",
    "modules_to_save": "modules_to_save",
    "rank_pattern": "rank_pattern",
    "alpha_pattern": "alpha_pattern",
    "layer_replication": "layer_replication",
    "use_qalora": "QALoRA",
    "exclude_modules": "exclude_modules",
    "lora_bias": "lora_bias",
    "target_parameters": "target_parameters",
    "trainable_token_indices": "trainable_token_indices",
    "alora_invocation_tokens": "aLoRA",
    "arrow_config": "Arrow",
    "megatron_config": "Megatron layers",
    "velora_config": "VeLoRA",
    "monteclora_config": "MonteCLoRA",
    "use_bdlora": "BD-LoRA",
    "kasa_config": "KaSA",
}
# Fields that do not change what a trained adapter computes: training, initialisation,
# bookkeeping. Any other field set to a value is refused (a newer PEFT's feature).
IGNORED = frozenset(
    {
        "task_type", "auto_mapping", "peft_version", "base_model_name_or_path", "revision",
        "inference_mode", "lora_dropout", "init_lora_weights", "loftq_config",
        "eva_config", "corda_config", "lora_ga_config", "megatron_core", "runtime_config",
        "qalora_group_size", "ensure_weight_tying",
    }
)  # fmt: skip


@dataclass(frozen=True)
class AdapterIdentity:
    """One adapter version as its files say: weights hash, config hash and the fields of
    its config an audit row shows (rank, alpha, targets)."""

    sha256: str
    config_sha256: str
    rank: int
    alpha: float
    target_modules: tuple[str, ...]

    @property
    def digest(self) -> str:
        return adapter_digest(self.config_sha256, self.sha256)


def _sorted_names(value: Any) -> Any:
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return sorted(set(value))
    return value


def _normalised(name: str, value: Any) -> Any:
    if name == "peft_type" and isinstance(value, str):
        return value.upper()
    if name == "lora_alpha" and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if name == "target_modules":
        return _sorted_names(value)
    if name == "layers_to_transform" and isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if name == "layers_to_transform" and isinstance(value, list):
        ints = all(isinstance(v, int) and not isinstance(v, bool) for v in value)
        return sorted(set(value)) if ints else value
    return value


def canonical_config(config: dict[str, Any]) -> dict[str, Any]:
    """The math fields of ``config``: every supported one (its default where absent),
    and each refused one that is set."""
    canonical = {k: _normalised(k, config.get(k, d)) for k, d in SUPPORTED.items()}
    canonical.update({k: config[k] for k in REFUSED if config.get(k)})
    return canonical


def config_sha256(config: dict[str, Any]) -> str:
    """sha256 of the canonical JSON (sorted keys, no spaces) of ``canonical_config``."""
    body = json.dumps(canonical_config(config), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(CONFIG_DOMAIN + body.encode()).hexdigest()


def adapter_digest(config_hash: str, weights_hash: str) -> str:
    """The adapter version's identity: sha256 over its config's and its weights' hashes."""
    return hashlib.sha256(DIGEST_DOMAIN + f"{config_hash}\n{weights_hash}".encode()).hexdigest()


def identity_of(config: dict[str, Any], weights_hash: str) -> AdapterIdentity:
    """The identity of an adapter whose config is ``config`` and weights hash so."""
    canonical = canonical_config(config)
    targets = canonical["target_modules"]
    targets = [targets] if isinstance(targets, str) else list(targets or [])
    return AdapterIdentity(
        weights_hash,
        config_sha256(config),
        canonical["r"],
        canonical["lora_alpha"],
        tuple(targets),
    )


def parse_config(raw: bytes) -> dict[str, Any]:
    """The JSON object ``raw`` holds; ValueError naming the file when it holds none."""
    try:
        config = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{CONFIG_FILE} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{CONFIG_FILE} is not a JSON object")
    return config


def refusal(config: dict[str, Any]) -> str | None:
    """Why the loader cannot run ``config`` as PEFT would, or None."""
    peft_type = config.get("peft_type", "")
    if str(peft_type).upper() != "LORA":
        return f"PEFT type {peft_type!r} is not supported, only LORA"
    for key, what in REFUSED.items():
        if config.get(key):
            return f"{what} ({key}={config[key]!r}) is not supported"
    if config.get("bias", "none") != "none":
        return f"bias={config['bias']!r} is not supported"
    unknown = sorted(k for k, v in config.items() if v and k not in _KNOWN)
    if unknown:
        return (
            f"config field {unknown[0]}={config[unknown[0]]!r} is not one this loader "
            "knows (it may change the math): not supported"
        )
    return None


_KNOWN = frozenset(SUPPORTED) | frozenset(REFUSED) | IGNORED


def changes(before: Any, now: AdapterIdentity, since: str = "registration") -> list[str]:
    """What of ``now`` differs from ``before`` (an identity, or a registry record written
    before config hashes: its rank, alpha and targets are compared), said for an
    operator; [] when nothing does."""
    said = []
    if before.sha256 != now.sha256:
        said.append(
            f"weights changed since {since} (sha256 {before.sha256[:12]}… then, "
            f"{now.sha256[:12]}… now)"
        )
    fields = [
        f"{name} {was!r} -> {is_!r}"
        for name, was, is_ in (
            ("r", before.rank, now.rank),
            ("lora_alpha", float(before.alpha), now.alpha),
            ("target_modules", list(before.target_modules), list(now.target_modules)),
        )
        if was != is_
    ]
    hashed = getattr(before, "config_sha256", None)
    if hashed is not None and hashed != now.config_sha256:
        fields.append(f"config sha256 {hashed[:12]}… then, {now.config_sha256[:12]}… now")
    if fields:
        said.append(f"{CONFIG_FILE} changed since {since} ({'; '.join(fields)})")
    return said
