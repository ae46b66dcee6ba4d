"""Kernel launch configurations measured on a device, read from ``kernels/configs/``.

One JSON file per device model, named by ``device_key`` (``NVIDIA H200`` ->
``NVIDIA_H200.json``), written by the GPU kit's sweep:

    {"device": "NVIDIA H200",
     "ops": {"<op>": {"<key>": {"BLOCK_K": 64, "SPLIT_K": 4, "BLOCK_N": 64,
                                "num_warps": 4, "num_stages": 2}}}}

``op`` names the call that reads the entry (``lora_ops``: "lora_shrink",
"lora_expand", "lora_linear") and ``key`` is that module's ``config_key`` of the
call's shape. An entry may hold only some of the fields; the caller's heuristics
choose the rest. A CPU device (the interpreter), a device without a file, an op
or a key not in it: ``lookup`` returns None, and the caller uses its heuristics.

The file is read once per device model, at the first lookup, and never again:
a process sees the configurations it started with.
"""

import functools
import json
import re
from pathlib import Path

import torch

CONFIG_DIR = Path(__file__).parent / "configs"


def lookup(device: torch.device, op: str, key: str) -> dict | None:
    """The measured configuration of ``op`` at shape ``key`` on ``device``; None if none."""
    if device.type != "cuda":
        return None
    return _configs(device_key(device)).get(op, {}).get(key)


def device_key(device: torch.device) -> str:
    """The device model as a file name: ``torch.cuda.get_device_name`` with every run of
    characters other than letters, digits, ``.`` and ``-`` made one ``_``."""
    return _device_key(device.index if device.index is not None else torch.cuda.current_device())


def config_path(device: torch.device) -> Path:
    """The file ``lookup`` reads for ``device`` (the sweep writes it)."""
    return CONFIG_DIR / f"{device_key(device)}.json"


@functools.cache
def _device_key(index: int) -> str:
    return re.sub(r"[^A-Za-z0-9.-]+", "_", torch.cuda.get_device_name(index)).strip("_")


@functools.cache
def _configs(key: str) -> dict:
    """``ops`` of the device's file, {} when there is none."""
    path = CONFIG_DIR / f"{key}.json"
    if not path.exists():
        return {}
    ops = json.loads(path.read_text()).get("ops", {})
    if not isinstance(ops, dict):
        raise ValueError(f"{path}: 'ops' must be an object of op -> key -> config")
    return ops
