"""What a model or an adapter *is*: the sha256 of its weights. Torch-free.

One definition, used by the engine (when it loads), the worker (the pool's
base model), the registry (an adapter at registration) and so the audit
records: they agree because they call the same functions.

- a model: sha256 over the bytes of its safetensors files, in sorted name
  order (the files the index names, for a sharded checkpoint);
- an adapter: sha256 of ``adapter_model.safetensors``.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from lorapool.records.adapter import ModelIdentity

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PICKLE_PATTERNS = ("*.bin", "*.pt", "*.pth", "*.ckpt")


def safetensors_files(path: str | Path) -> list[Path]:
    """A model checkpoint's safetensors files, sorted by name."""
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


def _digest(files: list[Path]) -> str:
    digest = hashlib.sha256()
    for file in files:
        with open(file, "rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
    return digest.hexdigest()


def file_sha256(path: str | Path) -> str:
    """Hex sha256 of one file's bytes."""
    return _digest([Path(path)])


def weights_sha256(path: str | Path) -> str:
    """Hex sha256 of a model directory's weights (see the module docstring)."""
    return _digest(safetensors_files(path))


def adapter_sha256(path: str | Path) -> str:
    """Hex sha256 of an adapter directory's weights."""
    return file_sha256(Path(path) / ADAPTER_WEIGHTS)


def model_identity(path: str | Path) -> ModelIdentity:
    """The name and weights' sha256 of a model directory: what the pool and its audit
    rows record."""
    path = Path(path)
    return ModelIdentity(path.name or str(path), weights_sha256(path))
