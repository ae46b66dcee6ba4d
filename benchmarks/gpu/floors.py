"""What a decode step cannot beat: the bytes floor and the practical (GEMM) floor.

- Bytes floor: the bytes a decode step of ``batch`` sequences must read, over
  the copy bandwidth of section 1. Every weight once, except the embedding
  table, of which a step reads ``batch`` rows (a tied table is read whole by
  the LM head, so it counts whole); each sequence's KV cache up to its context;
  each adapter in the step once (its A and B at its rank, on its targets).
- Practical floor: a CUDA graph of just the step's GEMMs (every linear layer's
  weight times a ``batch``-row input, the LM head included) replayed; what the
  best GEMM library does with the same bytes on this device, launch gaps gone.
  On the CPU the same products run in a loop, timed by the wall clock.
"""

from __future__ import annotations

import torch

from . import models
from .timing import replay_time


def weight_bytes(model: torch.nn.Module, batch: int) -> int:
    """Bytes of the weights a decode step of ``batch`` tokens reads (embedding: its rows)."""
    embed = _embedding(model)
    total = 0
    for param in model.parameters():  # a tied table is one parameter, counted whole
        if embed is not None and param is embed and not _tied(model, embed):
            total += batch * param.shape[1] * param.element_size()
        else:
            total += param.numel() * param.element_size()
    return total


def _embedding(model) -> torch.Tensor | None:
    for module in model.modules():
        if isinstance(module, torch.nn.Embedding):
            return module.weight
    return None


def _tied(model, embed: torch.Tensor) -> bool:
    return any(
        name != "model.embed_tokens.weight" and p.data_ptr() == embed.data_ptr()
        for name, p in model.named_parameters(remove_duplicate=False)
    )


def kv_bytes_per_token(model, itemsize: int) -> int:
    args = model.args
    return 2 * args.num_layers * args.num_kv_heads * args.head_dim * itemsize


def adapter_bytes(shape, adapter_dirs, itemsize: int) -> int:
    """Bytes of the adapters' A and B (their ranks, their targets) in the engine's dtype."""
    from peft import LoraConfig

    total = 0
    for path in adapter_dirs:
        config = LoraConfig.from_pretrained(str(path))
        for target in config.target_modules:
            fan_in, fan_out = models._projection_shape(shape, target)
            total += config.r * (fan_in + fan_out) * itemsize * shape.num_hidden_layers
    return total


def step_bytes(model, batch: int, context_tokens: float, itemsize: int, lora_bytes: int = 0):
    """(total, parts) bytes of one decode step; ``context_tokens``: the step's contexts summed."""
    parts = {
        "weights": weight_bytes(model, batch),
        "kv": int(context_tokens * kv_bytes_per_token(model, itemsize)),
        "lora": lora_bytes,
    }
    return sum(parts.values()), parts


def linears(model) -> list[torch.nn.Module]:
    """The model's linear layers in order: modules with an ``in_features`` and a 2-D weight."""
    out = []
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if (
            hasattr(module, "in_features")
            and isinstance(weight, torch.Tensor)
            and weight.dim() == 2
        ):
            out.append(module)
    return out


def gemm_floor(model, batch: int, device: str, window=None) -> dict:
    """Seconds of one replay of every linear layer's GEMM at ``batch`` rows (``replay_time``)."""
    layers = linears(model)
    dtype = layers[0].weight.dtype
    inputs = {
        n: torch.randn(batch, n, device=device, dtype=dtype)
        for n in {m.weight.shape[1] for m in layers}
    }
    outs = [torch.empty(batch, m.weight.shape[0], device=device, dtype=dtype) for m in layers]

    @torch.inference_mode()
    def step():
        for module, out in zip(layers, outs):
            torch.mm(inputs[module.weight.shape[1]], module.weight.t(), out=out)

    timed = replay_time([step], device, window=window)
    timed["gemms"] = len(layers)
    return timed
