"""Models, tokenizers and LoRA adapters made on the device: random weights, nothing fetched.

A model directory is what the engine loads from disk: a transformers config,
safetensors weights (float32) and a tokenizer. The weights are drawn on the
device with a seeded generator at scales that keep logits far from uniform
(norms around 1, linear weights ~ 1/sqrt(fan-in)), so a forward-pass bug
changes tokens. The tokenizer is a word-level one with one token per id
("t0", "t1", ...): the engine needs a tokenizer to detokenize, the kit feeds
token ids. Adapters are PEFT's format (``adapter_config.json`` written by
``peft.LoraConfig``, ``adapter_model.safetensors`` with PEFT's key names), so
PEFT loads them as the oracle does.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .plan import ModelShape

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
TARGET_SETS = (ALL_TARGETS, ("q_proj", "v_proj"), ("o_proj", "down_proj", "gate_proj"))
EOS, BOS = 2, 1


def hf_config(shape: ModelShape):
    from transformers import LlamaConfig, Qwen3Config

    kwargs = dict(
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        vocab_size=shape.vocab_size,
        max_position_embeddings=shape.max_position_embeddings,
        tie_word_embeddings=shape.tie_word_embeddings,
        rms_norm_eps=1e-5,
        bos_token_id=BOS,
        eos_token_id=EOS,
    )
    if shape.arch == "qwen3":
        return Qwen3Config(head_dim=shape.head_dim, **kwargs)
    return LlamaConfig(**kwargs)


def build_model(shape: ModelShape, root: Path, device: str, seed: int = 0, load: bool = True):
    """The model of ``shape`` in ``root/<name>`` (built once); returns (path, fp32 HF model).

    The transformers model stays on the device, in float32, for the oracle; with
    ``load=False`` an existing directory is not loaded and None comes back for it.
    """
    from transformers import AutoModelForCausalLM

    path = Path(root) / shape.name
    if (path / "config.json").is_file():
        return path, load_hf(path, device, torch.float32) if load else None
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf_config(shape), dtype=torch.float32)
    _randomize(model, seed, device)
    model.eval()
    model.save_pretrained(path, safe_serialization=True)
    write_tokenizer(path, shape.vocab_size)
    return path, model


def load_hf(path: Path, device: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).to(device).eval()


@torch.no_grad()
def _randomize(model: torch.nn.Module, seed: int, device: str) -> None:
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, param in model.named_parameters():
        noise = torch.randn(param.shape, generator=gen, device=device)
        if "norm" in name:
            param.copy_(1.0 + 0.2 * noise)
        elif "embed_tokens" in name:
            param.copy_(0.5 * noise)
        else:
            param.copy_(noise / param.shape[-1] ** 0.5)


def write_tokenizer(path: Path, vocab_size: int) -> None:
    """A word-level tokenizer of ``vocab_size`` tokens "t<i>", <|im_start|>=1 and <|im_end|>=2."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    vocab.pop("t1"), vocab.pop("t2")
    vocab |= {"<|im_start|>": BOS, "<|im_end|>": EOS}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
        unk_token="t0",
    )
    fast.save_pretrained(path)


def build_adapter(
    model_path: Path, out: Path, shape: ModelShape, rank: int, targets, seed: int, device: str
) -> Path:
    """A PEFT LoRA adapter of ``rank`` on ``targets`` with seeded random A and B (B non-zero).

    Scales: A ~ 1/sqrt(fan-in), B ~ 0.3/sqrt(rank), alpha = rank, so each update is
    about a third of its projection's output: big enough to change tokens, small
    enough that bf16 does not overflow.
    """
    from peft import LoraConfig
    from safetensors.torch import save_file

    out = Path(out)
    if (out / "adapter_config.json").is_file():
        return out
    config = LoraConfig(
        r=rank,
        lora_alpha=rank,
        target_modules=list(targets),
        lora_dropout=0.0,
        task_type="CAUSAL_LM",
        base_model_name_or_path=str(model_path),
    )
    config.save_pretrained(out)
    gen = torch.Generator(device=device).manual_seed(seed)
    tensors = {}
    for layer in range(shape.num_hidden_layers):
        for target in targets:
            fan_in, fan_out = _projection_shape(shape, target)
            prefix = f"base_model.model.model.layers.{layer}.{_block(target)}.{target}"
            a = torch.randn(rank, fan_in, generator=gen, device=device) / fan_in**0.5
            b = torch.randn(fan_out, rank, generator=gen, device=device) * 0.3 / rank**0.5
            tensors[f"{prefix}.lora_A.weight"] = a.cpu().contiguous()
            tensors[f"{prefix}.lora_B.weight"] = b.cpu().contiguous()
    save_file(tensors, str(out / "adapter_model.safetensors"))
    return out


def _block(target: str) -> str:
    return "self_attn" if target in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"


def _projection_shape(shape: ModelShape, target: str) -> tuple[int, int]:
    head_dim = shape.head_dim or shape.hidden_size // shape.num_attention_heads
    q = shape.num_attention_heads * head_dim
    kv = shape.num_key_value_heads * head_dim
    hidden, inter = shape.hidden_size, shape.intermediate_size
    return {
        "q_proj": (hidden, q),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (q, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }[target]


def adapters_for(model_path: Path, shape: ModelShape, root: Path, count: int, ranks, device: str):
    """``count`` adapters on the model (ranks and target sets in turn): {name: dir}."""
    out = {}
    for i in range(count):
        rank, targets = ranks[i % len(ranks)], TARGET_SETS[i % len(TARGET_SETS)]
        name = f"{shape.name}-lora{i}-r{rank}"
        out[name] = build_adapter(model_path, root / name, shape, rank, targets, 100 + i, device)
    return out


def prompts(count: int, length: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """Random prompts of token ids (lengths ``length``/2 .. ``length``), never special ids."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        n = int(torch.randint(max(1, length // 2), length + 1, (1,), generator=gen))
        out.append(torch.randint(3, vocab_size, (n,), generator=gen).tolist())
    return out


def write_json(path: Path, data) -> None:
    Path(path).write_text(json.dumps(data))
