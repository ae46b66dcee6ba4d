"""Section: the decode step of an 8B Llama (Llama-3.1-8B's shape), random weights.

The model is never written nor read: its directory holds a config and a
tokenizer, and the engine's loader is replaced, in this section's process only,
by one that builds the model on the device and draws its weights there (16 GB in
bf16 in well under a second), at the scales ``models`` uses. No transformers
model: nothing here compares tokens with an oracle (the ~1B shape does that).
Adapters (``big_adapters``, rank ``adapter_rank``) are PEFT files as elsewhere.

Figures: the decode step with CUDA graphs at each decode batch, base and
adapters, against the bytes floor and the practical floor (``decode_step``);
the implied tokens/s of each (batch / mean step). Check: every request got its
``decode_tokens`` tokens.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from . import decode_step, models, oracle, throughput
from .timing import CompileGuard


def run(ctx, rec) -> None:
    sizes = ctx.sizes
    shape = sizes.big_model
    rec.figure("model", shape.name)
    path = _model_dir(shape, Path(ctx.workdir) / "models")
    t0 = time.time()
    adapters = models.adapters_for(
        path,
        shape,
        Path(ctx.workdir) / "big-adapters",
        sizes.big_adapters,
        (sizes.adapter_rank,),
        ctx.device,
    )
    rec.figure("adapters_build_s", round(time.time() - t0, 1))
    _patch_loader(ctx.device)
    engine = throughput.make_engine(ctx, rec, path, len(adapters))
    params = sum(p.numel() for p in engine.runner.model.parameters())
    rec.figure("parameters_B", round(params / 1e9, 3))
    rec.figure(
        "weights_GB",
        round(sum(p.numel() * p.element_size() for p in engine.runner.model.parameters()) / 1e9, 2),
    )
    guard = CompileGuard()
    practical = decode_step.practical_floors(ctx, rec, engine, guard)
    graphs = getattr(engine.runner, "graphs", None)
    mode = "graphs" if graphs is not None else "eager"
    wanted = ("base", f"lora{min(sizes.adapter_counts)}")
    for where, loras in throughput.configurations(ctx, adapters, (mode,), wanted):
        key = (where["label"], where["batch"], mode)
        if ctx.time_left() < 0:
            rec.cut_short(f"the 8B decode step {key} and what follows")
            break
        run_ = throughput._measured(
            rec,
            f"8B decode step {key}",
            decode_step.decode_run,
            engine,
            ctx,
            shape,
            where["batch"],
            loras,
            guard,
            f"8B {key}",
        )
        if run_ is None:
            continue
        decode_step.record(ctx, rec, engine, shape, run_, where, practical)
        rec.figure(f"tokens_per_s_{key[0]}_b{key[1]}", round(key[1] / run_.mean_step_s, 1))
        rec.check(
            f"8B {key}: every request got its {sizes.decode_tokens} tokens",
            all(len(t) == sizes.decode_tokens for t in run_.tokens),
            str([len(t) for t in run_.tokens][:8]),
        )
    first = sizes.decode_batches[0]
    for name in ("decode_step_ms", "step_over_practical_floor", "step_over_bytes_floor"):
        key = f"{name}_base_b{first}_{mode}"
        if key in rec.data["figures"]:
            rec.figure(f"acceptance_8b_{name}", rec.data["figures"][key])
    guard.report(rec, "big")
    del engine
    oracle.free()


def _model_dir(shape, root: Path) -> Path:
    """A directory with the config and tokenizer of ``shape`` and no weights."""
    path = root / shape.name
    if not (path / "config.json").is_file():
        path.mkdir(parents=True, exist_ok=True)
        config = models.hf_config(shape)
        config.architectures = ["Qwen3ForCausalLM" if shape.arch == "qwen3" else "LlamaForCausalLM"]
        config.save_pretrained(path)
        models.write_tokenizer(path, shape.vocab_size)
    return path


def _patch_loader(device: str) -> None:
    """The engine's ``load_model``, wherever the engine imports it from, builds at random."""
    from lorapool.engine import loader, model_runner

    for module in (loader, model_runner):
        if hasattr(module, "load_model"):
            module.load_model = random_model


def random_model(path, dtype: torch.dtype = torch.float32, device="cpu", **model_options):
    """``loader.load_model``'s contract, the weights drawn on ``device`` (seed 0);
    ``model_options`` (``fused``, ...) go to the model class as the loader passes them."""
    from transformers import AutoConfig

    from lorapool.engine.models import get_model_class

    config = AutoConfig.from_pretrained(path)
    with torch.device(device):
        model = get_model_class(config)(config, dtype=dtype, **model_options)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.2, generator=gen)
            elif "embed_tokens" in name:
                param.normal_(0.0, 0.5, generator=gen)
            else:
                param.normal_(0.0, param.shape[-1] ** -0.5, generator=gen)
    return model.eval(), config
