"""The shape and options of a Llama-family model, read from a Hugging Face config.

One dataclass covers Llama 2/3, Mistral, SmolLM2, Qwen2 and Qwen3: the
families differ only in biases, q/k norms, head size and RoPE scaling.
"""

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ModelArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool

    @classmethod
    def from_hf_config(cls, config) -> "ModelArgs":
        """Read a transformers config (4.x or 5.x layout); raise on what we cannot run."""
        _check_supported(config)
        model_type = getattr(config, "model_type", "")
        attention_bias = bool(getattr(config, "attention_bias", False))
        num_heads = config.num_attention_heads
        theta, scaling = rope_settings(config)
        return cls(
            **{name: getattr(config, name) for name in _SAME_IN_CONFIG},
            num_layers=config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // num_heads,
            rope_theta=theta,
            rope_scaling=scaling,
            qkv_bias=attention_bias or model_type == "qwen2",
            o_bias=attention_bias and model_type != "qwen2",
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        )


# ModelArgs fields a transformers config holds under the same name, as they are
_SAME_IN_CONFIG = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "rms_norm_eps",
    "max_position_embeddings",
)


def rope_settings(config) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling parameters or None for plain RoPE).

    transformers 5 keeps everything in ``config.rope_parameters`` (theta
    included; ``rope_scaling`` is an alias of it); 4.x has ``rope_theta`` and
    an optional ``rope_scaling`` dict whose type key is ``type`` or ``rope_type``.
    """
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    params = dict(params or {})
    theta = params.pop("rope_theta", None) or getattr(config, "rope_theta", None) or 10000.0
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if rope_type == "default":
        return float(theta), None
    return float(theta), {"rope_type": rope_type, **params}


def sliding_window(config) -> int | None:
    """The attention window in effect, or None when every layer attends to everything."""
    window = getattr(config, "sliding_window", None)
    if not getattr(config, "use_sliding_window", True):
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    return window


def _check_supported(config) -> None:
    window = sliding_window(config)
    if window is not None and window < config.max_position_embeddings:
        raise ValueError(
            f"sliding-window attention (sliding_window={window} < max_position_embeddings="
            f"{config.max_position_embeddings}) is not supported"
        )
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act={act!r} is not supported (only 'silu')")
