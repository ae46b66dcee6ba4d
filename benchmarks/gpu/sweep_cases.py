"""The sweep's cases (``sweep.py``): one op at one shape the engine's CUDA graphs run,
its candidate launch configs, and the calls that time them (inputs built from a
picklable spec, so that the compile pool's processes build their own)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .timing import copies_for

MAX_CANDIDATES = 6  # per op and shape, besides the old launch
ADAPTERS = 8  # adapters in a swept LoRA call, tokens round-robin over them


@dataclass(frozen=True)
class Case:
    """One op at one shape: ``spec`` is what builds its inputs (picklable)."""

    op: str
    key: str
    spec: dict = field(hash=False)


def _shape(ctx):
    return ctx.sizes.models[0]


def attention_cases(ctx, dtype) -> list[Case]:
    from lorapool.kernels import attention_ops

    shape = _shape(ctx)
    head_size = shape.head_dim or shape.hidden_size // shape.num_attention_heads
    reach = shape.max_position_embeddings  # a graph's block tables reach max_model_len
    context = min(1024, reach // 4)  # each sequence's context in the timed calls
    out = []
    for tokens in ctx.sizes.sweep_batches or ctx.sizes.decode_batches:
        spec = dict(
            tokens=tokens,
            heads=shape.num_attention_heads,
            kv_heads=shape.num_key_value_heads,
            head_size=head_size,
            context=context,
            reach=reach,
            block_size=16,
            dtype=str(dtype).removeprefix("torch."),
        )
        key = attention_ops.config_key(
            tokens, tokens, spec["heads"], spec["kv_heads"], head_size, reach, dtype
        )
        out.append(Case("paged_attention", key, spec))
    return out


def lora_cases(ctx, dtype, rec) -> list[Case]:
    from lorapool.kernels import lora_ops

    if not all(hasattr(lora_ops, name) for name in ("candidates", "config_key")):
        rec.note("LoRA ops not swept: lora_ops has no candidates/config_key (tuning API) here")
        return []
    shape, rank = _shape(ctx), ctx.sizes.adapter_rank
    head_size = shape.head_dim or shape.hidden_size // shape.num_attention_heads
    q, kv = shape.num_attention_heads * head_size, shape.num_key_value_heads * head_size
    hidden, inter = shape.hidden_size, shape.intermediate_size
    projections = {  # the engine's packed projections: (H_in, slice widths)
        "qkv": (hidden, (q, kv, kv)),
        "o": (q, (hidden,)),
        "gate_up": (hidden, (inter, inter)),
        "down": (inter, (hidden,)),
    }
    ops = [op for op in ("lora_shrink", "lora_expand", "lora_linear") if hasattr(lora_ops, op)]
    out, seen = [], set()
    for tokens in ctx.sizes.sweep_batches or ctx.sizes.decode_batches:
        for name, (h_in, widths) in projections.items():
            spec = dict(
                tokens=tokens,
                hidden=h_in,
                widths=list(widths),
                rank=rank,
                dtype=str(dtype).removeprefix("torch."),
                projection=name,
            )
            for op in ops:
                shrink = op != "lora_expand"
                key = lora_ops.config_key(
                    tokens,
                    rank,
                    len(widths),
                    hidden=h_in if shrink else None,
                    widths=None if op == "lora_shrink" else widths,
                )
                if (op, key) not in seen:  # o and down expand alike: one key
                    seen.add((op, key))
                    out.append(Case(op, key, spec))
    return out


def candidates_of(case: Case) -> list[dict]:
    from lorapool.kernels import attention_ops, lora_ops

    if case.op == "paged_attention":
        return attention_ops.candidates(1)
    spec = case.spec
    hidden = None if case.op == "lora_expand" else spec["hidden"]
    widths = None if case.op == "lora_shrink" else spec["widths"]
    return lora_ops.candidates(case.op, hidden=hidden, widths=widths)


def pick(configs: list[dict], most: int = MAX_CANDIDATES) -> list[dict]:
    """At most ``most`` of ``configs``, spread evenly over the list (first and last in)."""
    if len(configs) <= most:
        return list(configs)
    if most == 1:
        return [configs[len(configs) // 2]]
    step = (len(configs) - 1) / (most - 1)
    return [configs[round(i * step)] for i in range(most)]


# --- inputs and calls -------------------------------------------------------------


def make_calls(case: Case, device: str, many: bool = False, seed: int = 0):
    """(call(config, i) -> a thunk of the op on copy i, result(config) -> a fresh output,
    copies): one copy of the inputs, or (``many``) enough to outgrow L2 (``copies_for``)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    dtype = getattr(torch, case.spec["dtype"])
    build = _attention_calls if case.op == "paged_attention" else _lora_calls
    return build(case, device, dtype, gen, many)


def _copies(inputs, device: str, many: bool) -> list:
    """One set of inputs, then as many more as L2 asks for (when ``many``)."""
    first = inputs()
    if not many:
        return [first]
    nbytes = sum(t.numel() * t.element_size() for t in first)
    return [first] + [inputs() for _ in range(copies_for(nbytes, device) - 1)]


def _attention_calls(case, device, dtype, gen, many):
    spec = case.spec
    from lorapool.kernels import attention_ops

    tokens, bs = spec["tokens"], spec["block_size"]
    per_seq = -(-spec["context"] // bs)
    num_blocks = tokens * per_seq + 1
    tables = torch.zeros(tokens, spec["reach"] // bs, dtype=torch.int32, device=device)
    tables[:, :per_seq] = 1 + torch.arange(tokens * per_seq, device=device).view(tokens, per_seq)
    seq_lens = torch.full((tokens,), spec["context"], dtype=torch.int32, device=device)
    qsl = torch.arange(tokens + 1, dtype=torch.int32, device=device)
    cache_shape = (num_blocks, bs, spec["kv_heads"], spec["head_size"])

    def inputs():
        q = torch.randn(tokens, spec["heads"], spec["head_size"], generator=gen, device=device)
        k = torch.randn(cache_shape, generator=gen, device=device)
        v = torch.randn(cache_shape, generator=gen, device=device)
        return q.to(dtype), k.to(dtype), v.to(dtype)

    sets = _copies(inputs, device, many)
    scale = spec["head_size"] ** -0.5

    def call(config, i):
        q, k, v = sets[i]
        return lambda: attention_ops.paged_attention(q, k, v, tables, seq_lens, qsl, scale, config)

    return call, lambda config: call(config, 0)(), len(sets)


def _lora_calls(case, device, dtype, gen, many):
    from lorapool.kernels import LoRAMapping, lora_ops

    spec = case.spec
    tokens, hidden, widths, rank = spec["tokens"], spec["hidden"], spec["widths"], spec["rank"]
    slices, n = len(widths), sum(widths)
    mapping = LoRAMapping.from_slots([i % ADAPTERS for i in range(tokens)], device)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(dtype)

    def inputs():
        x = randn(tokens, hidden)
        a = randn(ADAPTERS, slices, rank, hidden, scale=hidden**-0.5).transpose(
            0, 1
        )  # [S, L, R, H]
        b = randn(ADAPTERS, rank, n, scale=rank**-0.5).transpose(1, 2)  # [L, N, R]
        y = torch.randn(slices, tokens, rank, generator=gen, device=device)
        out = torch.zeros(tokens, n, dtype=dtype, device=device)
        shrunk = torch.empty(slices, tokens, rank, dtype=torch.float32, device=device)
        return x, a, b, y, out, shrunk

    sets = _copies(inputs, device, many)

    def call(config, i):
        x, a, b, y, out, shrunk = sets[i]
        if case.op == "lora_shrink":
            return lambda: lora_ops.lora_shrink(x, a, mapping, 1.0, shrunk, config=config)
        if case.op == "lora_expand":
            return lambda: lora_ops.lora_expand(y, b, mapping, out, widths, config=config)
        return lambda: lora_ops.lora_linear(x, a, b, mapping, out, widths, config=config)

    def result(config):
        x, a, b, y, out, shrunk = sets[0]
        if case.op == "lora_shrink":
            return lora_ops.lora_shrink(x, a, mapping, 1.0, shrunk.clone(), config=config)
        fresh = torch.zeros_like(out)
        if case.op == "lora_expand":
            lora_ops.lora_expand(y, b, mapping, fresh, widths, config=config)
        else:
            lora_ops.lora_linear(x, a, b, mapping, fresh, widths, config=config)
        return fresh

    return call, result, len(sets)


# --- compile, check, time ---------------------------------------------------------


def least_bytes(case: Case) -> int:
    """Bytes the op must read and write at least: each tensor once, adapters' weights
    once per adapter, the output read and written where it accumulates."""
    spec = case.spec
    item = getattr(torch, spec["dtype"]).itemsize
    if case.op == "paged_attention":
        kv = 2 * spec["tokens"] * spec["context"] * spec["kv_heads"] * spec["head_size"]
        return item * (kv + 2 * spec["tokens"] * spec["heads"] * spec["head_size"])
    tokens, hidden, rank = spec["tokens"], spec["hidden"], spec["rank"]
    slices, n = len(spec["widths"]), sum(spec["widths"])
    adapters = min(ADAPTERS, tokens)
    x, a, y = (
        tokens * hidden * item,
        adapters * slices * rank * hidden * item,
        4 * slices * tokens * rank,
    )
    b, out = adapters * n * rank * item, 2 * tokens * n * item
    return {"lora_shrink": x + a + y, "lora_expand": y + b + out}.get(case.op, x + a + b + out)


# --- the configs file -------------------------------------------------------------
