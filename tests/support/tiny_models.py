"""Tiny random-weight Hugging Face models, built in-process (never fetched).

Weights are drawn with a seeded generator at a scale that makes attention
and logits far from uniform, and norm weights and biases are not left at
their 1 / 0 defaults, so that a forward-pass bug changes the logits visibly.
No tokenizer is written.
"""

from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
)

COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
)

LLAMA3_ROPE = dict(
    rope_type="llama3",
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=64,
)

ARCHS = {
    "llama": (LlamaConfig, {}),
    "llama3": (LlamaConfig, dict(rope_theta=500000.0, rope_scaling=LLAMA3_ROPE)),
    "mistral": (MistralConfig, dict(sliding_window=None, head_dim=32)),
    "qwen2": (Qwen2Config, dict(num_hidden_layers=3)),
    "qwen3": (Qwen3Config, dict(head_dim=32, num_hidden_layers=3)),
}


def build_tiny_model(
    arch: str,
    path,
    *,
    vocab_size: int = 512,
    tie_word_embeddings: bool | None = None,
    seed: int = 0,
    shard: bool = False,
    **config_overrides,
) -> Path:
    """Write a tiny float32 model of ``arch`` (one of ARCHS) to ``path`` and return the path.

    ``tie_word_embeddings=None`` keeps the config class default (untied);
    ``shard=True`` splits the weights into several files with an index.
    """
    config_class, arch_overrides = ARCHS[arch]
    kwargs = {**COMMON, **arch_overrides, "vocab_size": vocab_size, **config_overrides}
    if tie_word_embeddings is not None:
        kwargs["tie_word_embeddings"] = tie_word_embeddings
    config = config_class(**kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, seed)
    path = Path(path)
    max_shard_size = "100KB" if shard else "5GB"
    model.save_pretrained(path, safe_serialization=True, max_shard_size=max_shard_size)
    return path


@torch.no_grad()
def _randomize(model: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        noise = torch.randn(param.shape, generator=generator)
        if "norm" in name:
            param.copy_(1.0 + 0.2 * noise)
        elif name.endswith("bias"):
            param.copy_(0.1 * noise)
        elif "embed_tokens" in name:
            param.copy_(0.5 * noise)
        else:
            param.copy_(noise / param.shape[-1] ** 0.5)
