"""Model implementations and the registry of supported Hugging Face architectures.

May import: torch, transformers (configs), the engine's layers and ``lorapool.kernels``.
"""

from torch import nn

from lorapool.engine.models.llama import LlamaForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}

SUPPORTED_ARCHITECTURES = tuple(MODEL_REGISTRY)


def get_model_class(hf_config) -> type[nn.Module]:
    """The model class for a transformers config; ValueError if its architecture is unknown."""
    architectures = getattr(hf_config, "architectures", None) or []
    arch = architectures[0] if architectures else None
    if arch not in MODEL_REGISTRY:
        raise ValueError(
            f"unsupported model architecture {arch!r}; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return MODEL_REGISTRY[arch]
