"""Small seeded LoRA adapters in PEFT's format, for the demo (no training, no peft).

Each adapter nudges the base model differently, so requests served with
different adapters give visibly different completions.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoConfig

DEMO_ADAPTERS = {  # name -> (rank, targets, seed)
    "support-bot": (8, ("q_proj", "v_proj"), 1),
    "sql-writer": (16, ("q_proj", "k_proj", "v_proj", "o_proj"), 2),
    "poet": (8, ("gate_proj", "up_proj", "down_proj"), 3),
}


def _shapes(config, module: str) -> tuple[int, int]:
    """(in, out) features of one projection of the base model."""
    hidden, inter = config.hidden_size, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    kv = config.num_key_value_heads * head_dim
    q = config.num_attention_heads * head_dim
    return {
        "q_proj": (hidden, q),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (q, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }[module]


def write_adapter(
    model_dir: str | Path,
    out_dir: str | Path,
    rank: int,
    targets: tuple[str, ...],
    seed: int,
    std: float = 0.02,
) -> Path:
    """Write adapter_config.json + adapter_model.safetensors with seeded random A and B."""
    config = AutoConfig.from_pretrained(model_dir)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for module in targets:
            fan_in, fan_out = _shapes(config, module)
            kind = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            prefix = f"base_model.model.model.layers.{layer}.{kind}.{module}"
            a = torch.randn(rank, fan_in, generator=generator)
            b = torch.randn(fan_out, rank, generator=generator)
            tensors[f"{prefix}.lora_A.weight"] = a * std
            tensors[f"{prefix}.lora_B.weight"] = b * std
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "adapter_model.safetensors")
    (out / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "task_type": "CAUSAL_LM",
                "r": rank,
                "lora_alpha": 2 * rank,
                "target_modules": list(targets),
                "lora_dropout": 0.0,
                "bias": "none",
                "base_model_name_or_path": str(model_dir),
                "use_rslora": False,
                "use_dora": False,
                "modules_to_save": None,
                "fan_in_fan_out": False,
            },
            indent=2,
        )
    )
    return out


def ensure_demo_adapters(model_dir: str | Path, root: str | Path) -> dict[str, Path]:
    """The demo adapters under ``root`` (written once); name -> directory."""
    paths = {}
    for name, (rank, targets, seed) in DEMO_ADAPTERS.items():
        path = Path(root) / name
        if not (path / "adapter_model.safetensors").is_file():
            write_adapter(model_dir, path, rank, targets, seed)
        paths[name] = path
    return paths
