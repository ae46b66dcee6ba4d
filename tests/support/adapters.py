"""PEFT LoRA adapters built in-process on a base model directory, and PEFT as the oracle."""

import tempfile
from pathlib import Path

import torch
from oracle import greedy_options
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

_MODELS: dict[str, dict] = {}  # base path -> {"model": PeftModel, "loaded": {dir: name}}
ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build_adapter(
    base_path,
    out_dir,
    *,
    rank: int = 8,
    targets=("q_proj", "v_proj"),
    alpha: float | None = None,
    use_rslora: bool = False,
    seed: int = 0,
    std: float = 0.1,
    **config_kw,
) -> Path:
    """Save a PEFT LoRA adapter with seeded random A and B (B non-zero) to ``out_dir``."""
    base = AutoModelForCausalLM.from_pretrained(str(base_path), dtype=torch.float32)
    config = LoraConfig(
        r=rank,
        lora_alpha=rank if alpha is None else alpha,
        target_modules=list(targets),
        use_rslora=use_rslora,
        lora_dropout=0.0,
        task_type="CAUSAL_LM",
        **config_kw,
    )
    model = get_peft_model(base, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * std)
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def set_weight(adapter_dir, key: str, value: float, index=(0, 0)) -> str:
    """Write ``value`` into one element of the first weight whose name holds ``key``."""
    file = str(Path(adapter_dir) / "adapter_model.safetensors")
    weights = load_file(file)
    name = next(n for n in sorted(weights) if key in n)
    weights[name][index] = value
    save_file(weights, file)
    return name


@torch.inference_mode()
def peft_greedy(
    base_path, adapter_dir, prompt_ids: list[int], max_new_tokens: int, eos_token_id=2
) -> list[int]:
    """PEFT's generate, greedy, one request alone (``adapter_dir`` None: base model)."""
    model = _peft_model(str(base_path), None if adapter_dir is None else str(adapter_dir))
    input_ids = torch.tensor([prompt_ids])
    kwargs = greedy_options(input_ids, max_new_tokens, eos_token_id)
    if adapter_dir is None:
        with model.disable_adapter():
            out = model.generate(input_ids=input_ids, **kwargs)
    else:
        out = model.generate(input_ids=input_ids, **kwargs)
    return out[0, len(prompt_ids) :].tolist()


def _peft_model(base_path: str, adapter_dir: str | None):
    state = _MODELS.setdefault(base_path, {"model": None, "loaded": {}})
    names = state["loaded"]
    if state["model"] is None:
        base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32).eval()
        first = adapter_dir or _placeholder(base_path)
        state["model"] = PeftModel.from_pretrained(base, first, adapter_name="a0").eval()
        names[first] = "a0"
    model = state["model"]
    if adapter_dir is not None:
        if adapter_dir not in names:
            names[adapter_dir] = f"a{len(names)}"
            model.load_adapter(adapter_dir, adapter_name=names[adapter_dir])
        model.set_adapter(names[adapter_dir])
    return model


def _placeholder(base_path: str) -> str:
    return str(build_adapter(base_path, tempfile.mkdtemp(prefix="placeholder-lora-"), rank=1))
