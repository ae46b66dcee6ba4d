"""Section 3: the engine on the device against transformers and PEFT, greedy.

Per model (a ~1B Llama and a small Qwen3, generated on the device):

- fp32: our engine, every prompt in one batch, against transformers' generate
  of each prompt alone: token-exact. A difference where the oracle's own top two
  logits are within ``TIE_MARGIN`` is reported as a near tie (summation order
  may decide it), not as a failure; any other difference fails.
- bf16: both sides in bf16: the agreement (tokens before the first difference
  over all tokens) is reported, and how often the first ``bf16_exact_tokens``
  are equal; every first difference must be a near tie as vLLM's tests judge
  one (each side's token among the other's top ``TOP_K`` there). With random
  weights and no training, logits sit close together, and bf16 rounding in a
  different summation order (our Triton kernels against transformers' SDPA and
  cuBLAS) decides near ties either way; how close each side stays to fp32 is
  reported beside it.
- LoRA (fp32): adapters of ranks 8-64 on different projections and the base
  model mixed in one batch, against PEFT running each request alone: exact.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from . import models, oracle

TIE_MARGIN = 1e-3
TOP_K = 5  # vLLM's check_logprobs_close uses the top 5 of each side


def run(ctx, rec) -> None:
    sizes = ctx.sizes
    root = Path(ctx.workdir) / "models"
    for shape in sizes.models:
        if ctx.time_left() < 0:
            rec.cut_short(shape.name)
            return
        t0 = time.time()
        path, hf = models.build_model(shape, root, ctx.device)
        rec.figure(f"{shape.name}_build_s", round(time.time() - t0, 1))
        rec.figure(
            f"{shape.name}_params_M", float(f"{sum(p.numel() for p in hf.parameters()) / 1e6:.4g}")
        )
        prompts = models.prompts(sizes.parity_prompts, 32 if not ctx.tiny else 8, shape.vocab_size)
        fp32 = _fp32(ctx, rec, shape, path, hf, prompts)
        for name, part in (("bf16", _bf16), ("LoRA", _lora)):
            if ctx.time_left() < 0:
                rec.cut_short(f"{shape.name} {name}")
                break
            part(ctx, rec, shape, path, hf, prompts, fp32)
        del hf
        oracle.free()


def _fp32(ctx, rec, shape, path, hf, prompts) -> list[list[int]]:
    """Checks fp32 parity; returns transformers' fp32 tokens (the other parts reuse them)."""
    n = ctx.sizes.parity_tokens
    theirs = [oracle.hf_greedy(hf, p, n) for p in prompts]
    engine = oracle.make_engine(path, ctx.device, "float32", max_num_seqs=len(prompts))
    ours = oracle.engine_greedy(engine, prompts, n)
    del engine
    oracle.free()
    agree = oracle.agreement(ours, theirs)
    ties, real = [], []
    for i, pos in agree.first_diffs:
        margin = oracle.top2_margin(hf, prompts[i] + theirs[i][:pos])
        (ties if margin < TIE_MARGIN else real).append(
            f"request {i} token {pos}: margin {margin:.2e}"
        )
    rec.figure(f"{shape.name}_fp32_exact", f"{agree.exact}/{agree.total}")
    rec.figure(f"{shape.name}_fp32_agreement", agree.share)
    if ties:
        rec.note(f"{shape.name} fp32 near ties (not failures): {'; '.join(ties)}")
    rec.check(f"{shape.name} fp32 greedy token-exact vs transformers", not real, "; ".join(real))
    return theirs


def _bf16(ctx, rec, shape, path, hf_fp32, prompts, fp32_theirs) -> None:
    n, k = ctx.sizes.parity_tokens, ctx.sizes.bf16_exact_tokens
    hf = models.load_hf(path, ctx.device, torch.bfloat16)
    theirs = [oracle.hf_greedy(hf, p, n) for p in prompts]
    engine = oracle.make_engine(path, ctx.device, "bfloat16", max_num_seqs=len(prompts))
    ours, our_tops = oracle.engine_greedy_top(engine, prompts, n, k=TOP_K)
    del engine
    oracle.free()
    agree = oracle.agreement(ours, theirs)
    rec.figure(f"{shape.name}_bf16_exact", f"{agree.exact}/{agree.total}")
    rec.figure(f"{shape.name}_bf16_agreement", agree.share)
    first_k = sum(a[:k] == b[:k] for a, b in zip(ours, theirs))
    rec.figure(f"{shape.name}_bf16_first{k}_equal", f"{first_k}/{len(prompts)}")
    rec.figure(f"{shape.name}_bf16_vs_fp32_agreement", oracle.agreement(ours, fp32_theirs).share)
    rec.figure(
        f"{shape.name}_transformers_bf16_vs_fp32_agreement",
        oracle.agreement(theirs, fp32_theirs).share,
    )
    real = oracle.not_near_ties(
        ours,
        theirs,
        our_tops,
        lambda i, pos: oracle.hf_top(hf, prompts[i] + theirs[i][:pos], TOP_K),
    )
    hf = None  # the closure above names it: rebind, then free
    oracle.free()
    rec.check(
        f"{shape.name} bf16 greedy vs transformers bf16: every first difference a near tie "
        f"(each token in the other's top {TOP_K})",
        not real,
        "; ".join(real) + f" (first differences (request, token): {agree.first_diffs})",
    )


def _lora(ctx, rec, shape, path, hf, prompts, base) -> None:
    from peft import PeftModel

    from lorapool import LoRARequest

    sizes = ctx.sizes
    ranks = sizes.lora_ranks
    root = Path(ctx.workdir) / "adapters"
    dirs = models.adapters_for(path, shape, root, len(ranks), ranks, ctx.device)
    names = list(dirs)
    which = [
        None if i % (len(names) + 1) == 0 else names[i % (len(names) + 1) - 1]
        for i in range(len(prompts))
    ]
    loras = [None if w is None else LoRARequest(w, names.index(w) + 1, str(dirs[w])) for w in which]
    engine = oracle.make_engine(
        path,
        ctx.device,
        "float32",
        max_num_seqs=len(prompts),
        enable_lora=True,
        max_loras=len(names),
        max_lora_rank=max(ranks),
    )
    ours = oracle.engine_greedy(engine, prompts, sizes.parity_tokens, loras)
    del engine
    oracle.free()
    # PEFT names adapters as torch modules, which refuse dots ("qwen3-0.6b-...")
    peft_name = {name: name.replace(".", "_") for name in names}
    peft = PeftModel.from_pretrained(hf, str(dirs[names[0]]), adapter_name=peft_name[names[0]])
    for name in names[1:]:
        peft.load_adapter(str(dirs[name]), adapter_name=peft_name[name])
    theirs = []
    for prompt, name in zip(prompts, which):
        if name is None:
            with peft.disable_adapter():
                theirs.append(oracle.hf_greedy(peft, prompt, sizes.parity_tokens))
        else:
            peft.set_adapter(peft_name[name])
            theirs.append(oracle.hf_greedy(peft, prompt, sizes.parity_tokens))
    agree = oracle.agreement(ours, theirs)
    rec.figure(f"{shape.name}_lora_exact", f"{agree.exact}/{agree.total}")
    rec.figure(f"{shape.name}_lora_adapters", f"{len(names)} (ranks {list(ranks)}) + base")
    changed = sum(a != b for a, b, name in zip(theirs, base, which) if name)
    rec.figure(f"{shape.name}_lora_requests_changed_by_adapter", changed)
    rec.check(
        f"{shape.name} LoRA mixed batch token-exact vs PEFT",
        agree.exact == agree.total,
        f"first differences (request, token): {agree.first_diffs}",
    )
    peft.unload()
