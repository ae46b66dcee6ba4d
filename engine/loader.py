"""Load a local Hugging Face model directory: config, safetensors weights, identity.

Only safetensors are read; pickle checkpoints (``*.bin``, ``*.pt``) are
refused, never unpickled.
"""

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig, PretrainedConfig

from lorapool.engine.models import get_model_class

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
PICKLE_PATTERNS = ("*.bin", "*.pt", "*.pth", "*.ckpt")


def load_model(
    path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> tuple[torch.nn.Module, PretrainedConfig]:
    """Build the model of the directory ``path`` and load its weights.

    Returns (model in eval mode on ``device`` in ``dtype``, the transformers config).
    Raises ValueError for an unsupported architecture or a pickle-only checkpoint.
    """
    config = AutoConfig.from_pretrained(path)
    model_class = get_model_class(config)
    files = safetensors_files(path)
    with torch.device(device):
        model = model_class(config, dtype=dtype)
    model.load_weights(iter_weights(files))
    return model.eval(), config


def safetensors_files(path: str | Path) -> list[Path]:
    """The checkpoint's safetensors files, sorted by name."""
    path = Path(path)
    if (path / INDEX_FILE).is_file():
        weight_map = json.loads((path / INDEX_FILE).read_text())["weight_map"]
        return [path / name for name in sorted(set(weight_map.values()))]
    if (path / SINGLE_FILE).is_file():
        return [path / SINGLE_FILE]
    if any(next(path.glob(pattern), None) for pattern in PICKLE_PATTERNS):
        raise ValueError(
            f"{path} holds only pickle checkpoints (*.bin/*.pt), which are never "
            "loaded; convert the weights to safetensors"
        )
    raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in {path}")


def iter_weights(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor in the files, read on the CPU one at a time."""
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a Mapping
                yield name, f.get_tensor(name)


def weights_sha256(path: str | Path) -> str:
    """Hex sha256 over the bytes of the safetensors files, taken in sorted name order."""
    digest = hashlib.sha256()
    for file in safetensors_files(path):
        with open(file, "rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
    return digest.hexdigest()
