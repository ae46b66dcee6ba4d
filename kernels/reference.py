"""Plain torch implementations of every kernel op.

These are the specification the Triton kernels are tested against, and the
path CPU tensors take. Shapes use T = tokens in the batch, B = sequences,
H = heads, D = head size; for LoRA, S = slices of a packed projection, L =
adapter slots, R = the largest rank. Attention and LoRA compute in fp32; the
layer ops (RMSNorm, RoPE, SiLU) round as the model's torch ops do, in its dtype.
"""

import torch
import torch.nn.functional as F

from lorapool.kernels.attention_plan import AttentionPlan, DecodeGroup
from lorapool.kernels.lora_mapping import LoRAMapping, as_mapping


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Semantics: cache[slot[t] // block_size, slot[t] % block_size] = kv[t].

    Args:
        key, value: [T, H_kv, D]
        key_cache, value_cache: [num_blocks, block_size, H_kv, D], updated in place.
        slot_mapping: [T] int64, flat slot index of each token (all >= 0).
    """
    num_blocks, block_size, num_heads, head_size = key_cache.shape
    flat_k = key_cache.view(num_blocks * block_size, num_heads, head_size)
    flat_v = value_cache.view(num_blocks * block_size, num_heads, head_size)
    flat_k.index_copy_(0, slot_mapping, key.to(key_cache.dtype))
    flat_v.index_copy_(0, slot_mapping, value.to(value_cache.dtype))


def _gather_context(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    # cache: [N, bs, H, D], block_table: [MB] -> [length, H, D]
    block_size = cache.shape[1]
    num_blocks = -(-length // block_size)
    blocks = cache.index_select(0, block_table[:num_blocks].long())
    return blocks.reshape(-1, *cache.shape[2:])[:length]


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    plan: AttentionPlan | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its paged context.

    Semantics: for sequence b with q_len new tokens and seq_lens[b] tokens in
    all (its context, new tokens included, already written to the cache), new
    token i sits at position p = seq_lens[b] - q_len + i and
    out[t] = softmax(scale * q[t] @ K[b, :p + 1]^T) @ V[b, :p + 1].

    Only those positions count: any other cache slot (the tail of a last block,
    a padding entry of a block table, a freed block) may hold anything, NaN and
    Inf included, and leaves the result unchanged; padding is selected away,
    never multiplied by a zero.

    Args:
        query: [T, H_q, D], tokens of sequence b at query_start_loc[b]:query_start_loc[b + 1].
        key_cache, value_cache: [num_blocks, block_size, H_kv, D]; H_q % H_kv == 0 (GQA).
        block_tables: [B, max_blocks] int32, block ids of each sequence in order.
        seq_lens: [B] int32, context length of each sequence including its new tokens.
        query_start_loc: [B + 1] int32, cumulative new-token counts.
        plan: ``AttentionPlan.build`` of the three batch tensors above, when the
            caller built it once for several calls (the layers of a step).
    Returns:
        [T, H_q, D] in query's dtype, computed in fp32.
    """
    block_size = key_cache.shape[1]
    if plan is None:
        plan = AttentionPlan.build(block_tables, seq_lens, query_start_loc, block_size)
    elif plan.block_size != block_size:
        raise ValueError(f"the plan is for blocks of {plan.block_size}, the cache has {block_size}")
    out = torch.empty_like(query)
    for group in plan.decode:
        _decode_attention(query, key_cache, value_cache, group, scale, out)
    for seq in plan.prefill:
        k = _gather_context(key_cache, seq.blocks, seq.length)
        v = _gather_context(value_cache, seq.blocks, seq.length)
        out[seq.start : seq.end] = _prefill_attention(query[seq.start : seq.end], k, v, scale).to(
            out.dtype
        )
    return out


def _prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    # q: [Q, Hq, D], k/v: [L, Hkv, D]; the Q queries are the last Q positions of L.
    q_len, ctx_len = q.shape[0], k.shape[0]
    q4 = q.float().transpose(0, 1).unsqueeze(0)  # [1, Hq, Q, D]
    k4 = k.float().transpose(0, 1).unsqueeze(0)  # [1, Hkv, L, D]
    v4 = v.float().transpose(0, 1).unsqueeze(0)
    if q_len == ctx_len:
        o = F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=scale, enable_gqa=True)
    else:
        pos = torch.arange(ctx_len - q_len, ctx_len, device=q.device)
        mask = torch.arange(ctx_len, device=q.device)[None, :] <= pos[:, None]
        o = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask, scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1)  # [Q, Hq, D]


def _decode_attention(query, key_cache, value_cache, group: DecodeGroup, scale: float, out):
    # One new token per sequence: gather the group's contexts at once, padded to its longest.
    # index_select gathers blocks about twice as fast as advanced indexing, and SDPA
    # reads the gathered K/V through strides, without the copies an einsum makes.
    block_size, num_kv_heads, head_size = key_cache.shape[1:]
    shape = (len(group.tokens), group.num_blocks * block_size, num_kv_heads, head_size)
    k = key_cache.index_select(0, group.blocks).view(shape).float()  # [n, L, Hkv, D]
    v = value_cache.index_select(0, group.blocks).view(shape).float()
    # Padding slots may hold another request's NaN or Inf (a freed block), which
    # the mask alone does not stop: 0 * NaN is NaN in the softmax and in P @ V.
    k.masked_fill_(~group.valid[:, :, None, None], 0.0)
    v.masked_fill_(~group.valid[:, :, None, None], 0.0)
    q = query[group.tokens].float()[:, :, None, :]  # [n, Hq, 1, D]
    o = F.scaled_dot_product_attention(
        q,
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=group.valid[:, None, None, :],
        scale=scale,
        enable_gqa=True,
    )
    out[group.tokens] = o[:, :, 0].to(out.dtype)


def lora_shrink(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    slots,
    scale: float = 1.0,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Semantics: y[s, t] = scale * x[t] @ A[s, slot[t]]^T; y[s, t] = 0 where slot[t] == -1.

    Args:
        x: [T, H_in]
        lora_a: [S, L, R, H_in], the A matrices of S slices (q/k/v or gate/up
            stacked; S = 1 for a plain projection) for L adapter slots, padded
            with zeros to the largest rank R.
        slots: [T] integer tensor (or list) of adapter slots, -1 for none; or a
            ``LoRAMapping`` built from them.
        out: optional [S, T, R] float32 tensor to write y into.
    Returns:
        y: [S, T, R] float32.
    """
    num_slices, num_slots, rank, _ = lora_a.shape
    mapping = as_mapping(slots, x.device)
    _check_slots(mapping, num_slots)
    y = out if out is not None else x.new_empty(num_slices, x.shape[0], rank, dtype=torch.float32)
    y.zero_()
    for slot, start, end in mapping.segments:
        idx = mapping.token_indices(start, end)
        a = lora_a[:, slot].float()  # [S, R, H_in]
        y[:, idx] = scale * torch.matmul(x[idx].float(), a.transpose(1, 2))  # [S, n, R]
    return y


def lora_expand(
    y: torch.Tensor,
    lora_b: torch.Tensor,
    slots,
    out: torch.Tensor,
    slice_widths=None,
) -> None:
    """Semantics: out[t, o_s : o_s + n_s] += y[s, t] @ B[slot[t], o_s : o_s + n_s]^T.

    Slice s covers n_s = slice_widths[s] columns from o_s = sum(slice_widths[:s]),
    in ``out`` and in the rows of B alike: B is the per-slice B matrices
    [L, n_s, R] concatenated along their rows. Rows of tokens with slot -1 are
    left untouched. The sum is taken in float32, then stored in out's dtype.

    Args:
        y: [S, T, R] float32, from ``lora_shrink``.
        lora_b: [L, N, R] with N = sum(slice_widths); ranks below R zero-padded.
        slots: [T] adapter slots (-1 for none), or a ``LoRAMapping``.
        out: [T, N], updated in place.
        slice_widths: S column counts; None means one slice of all N columns.
    """
    widths = slice_widths_of(y, lora_b, slice_widths)
    mapping = as_mapping(slots, out.device)
    _check_slots(mapping, lora_b.shape[0])
    offsets = [sum(widths[:s]) for s in range(len(widths))]
    for slot, start, end in mapping.segments:
        idx = mapping.token_indices(start, end)
        b = lora_b[slot].float()  # [N, R]
        delta = torch.cat(
            [y[s, idx] @ b[o : o + n].T for s, (o, n) in enumerate(zip(offsets, widths))], dim=1
        )  # [n_tok, N]
        out[idx] = (out[idx].float() + delta).to(out.dtype)


def slice_widths_of(y: torch.Tensor, lora_b: torch.Tensor, slice_widths) -> list[int]:
    """The validated slice widths of an expand call."""
    return check_slice_widths(y.shape[0], lora_b.shape[1], slice_widths)


def check_slice_widths(num_slices: int, total: int, slice_widths) -> list[int]:
    """``slice_widths`` as ints: ``num_slices`` positive widths summing to ``total``
    (None: one slice of all ``total`` columns)."""
    widths = [total] if slice_widths is None else [int(w) for w in slice_widths]
    if len(widths) != num_slices:
        raise ValueError(f"y has {num_slices} slices but slice_widths gives {len(widths)}")
    if sum(widths) != total or min(widths) <= 0:
        raise ValueError(f"slice_widths {widths} must be positive and sum to lora_b's {total} rows")
    return widths


def _check_slots(mapping: LoRAMapping, num_slots: int) -> None:
    if mapping.max_slot >= num_slots:
        raise ValueError(
            f"LoRA slot {mapping.max_slot} is out of range: the weights have {num_slots} slots"
        )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Semantics: y = x / sqrt(mean(x^2) + eps) * weight over the last axis.

    Normalised in fp32; in half precision the normalised x is rounded to its
    dtype before the weight multiplies it (in that dtype), as transformers does.

    Args:
        x: [..., D] in the model dtype.
        weight: [D] in x's dtype.
    Returns:
        [..., D] in x's dtype.
    """
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    normed = F.rms_norm(x.float(), (x.shape[-1],), eps=eps)
    return weight * normed.to(x.dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """Semantics: residual += x (added in residual's dtype, in place); y = rms_norm(residual).

    Args:
        x, residual: [T, D]; residual is updated in place.
        weight: [D].
    Returns:
        y: [T, D] in residual's dtype.
    """
    residual.add_(x)
    return rms_norm(residual, weight, eps)


def rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Semantics: [x1, x2] -> [x1 * cos - x2 * sin, x2 * cos + x1 * sin], each op in x's dtype.

    Args:
        x: [T, H, D]; cos, sin: [T, 1, D/2] (broadcast over heads).
    """
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def rotary_write_kv(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
    positions: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> torch.Tensor:
    """RoPE on the new queries and keys; the keys and values written to the paged cache.

    Semantics: with c = cos_table[positions[t]], s = sin_table[positions[t]],
    q'[t] = rotate_half(norm_q(q[t]), c, s) is returned,
    cache[slot[t]] = (rotate_half(norm_k(k[t]), c, s), v[t]) where slot[t] >= 0
    (a negative slot, padding, writes nothing). norm_q, norm_k are the identity,
    or with ``qk_norm = (q_weight, k_weight, eps)`` (Qwen3) ``rms_norm`` of each
    head vector. Computed in the model dtype, as the unfused layers do.

    Args:
        query: [T, H_q, D]; key, value: [T, H_kv, D] (any token and head strides).
        cos_table, sin_table: [P, D/2] in the model dtype; positions: [T] int.
        key_cache, value_cache: [num_blocks, block_size, H_kv, D], updated in place.
        slot_mapping: [T] int, flat slot of each token, negative for none.
    Returns:
        q': [T, H_q, D] in query's dtype.
    """
    if qk_norm is not None:
        q_weight, k_weight, eps = qk_norm
        query, key = rms_norm(query, q_weight, eps), rms_norm(key, k_weight, eps)
    cos, sin = cos_table[positions].unsqueeze(1), sin_table[positions].unsqueeze(1)
    rotated_q, rotated_k = rotate_half(query, cos, sin), rotate_half(key, cos, sin)
    keep = slot_mapping >= 0
    write_kv_cache(rotated_k[keep], value[keep], key_cache, value_cache, slot_mapping[keep])
    return rotated_q


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """Semantics: y = silu(gate) * up, where [gate, up] are the two halves of gate_up's
    last axis and silu(g) = g / (1 + exp(-g)); each op in the input's dtype.

    Args:
        gate_up: [T, 2I].
    Returns:
        y: [T, I] in gate_up's dtype.
    """
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
