"""Load a local Hugging Face model directory: config, safetensors weights, identity.

Only safetensors are read; pickle checkpoints (``*.bin``, ``*.pt``) are
refused, never unpickled.
"""

from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig, GenerationConfig, PretrainedConfig

from lorapool.engine.models import get_model_class
from lorapool.identity import safetensors_files, weights_sha256

__all__ = ["eos_token_ids", "iter_weights", "load_model", "safetensors_files", "weights_sha256"]


def load_model(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    fused: bool = False,
) -> tuple[torch.nn.Module, PretrainedConfig]:
    """Build the model of the directory ``path`` and load its weights.

    ``fused``: run the fused layer kernels where the Triton kernels run
    (``EngineArgs.fused_layer_kernels``).

    Returns (model in eval mode on ``device`` in ``dtype``, the transformers config).
    Raises ValueError for an unsupported architecture or a pickle-only checkpoint.
    """
    config = AutoConfig.from_pretrained(path)
    model_class = get_model_class(config)
    files = safetensors_files(path)
    with torch.device(device):
        model = model_class(config, dtype=dtype, fused=fused)
    model.load_weights(iter_weights(files))
    return model.eval(), config


def iter_weights(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor in the files, read on the CPU one at a time."""
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a Mapping
                yield name, f.get_tensor(name)


def eos_token_ids(model: str, hf_config, tokenizer) -> set[int]:
    """The generation config's EOS ids (what transformers' generate stops on)."""
    try:
        eos = GenerationConfig.from_pretrained(model).eos_token_id
    except OSError:
        eos = None
    if eos is None:
        eos = getattr(hf_config, "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    ids = eos if isinstance(eos, list) else [eos]
    return {int(i) for i in ids if i is not None}
