"""Launch configurations of the paged attention kernel (``attention_ops``): the tuned
key of a call, what the GPU kit's sweep tries, today's heuristics and the split of a
context over programs (flash-decoding).

A config is a dict of some of ``CONFIG_KEYS``; ``paged_attention(config=None)`` takes
the device's measured entry (``kernels.tuned``) at ``config_key`` of the call over the
heuristics, an explicit config instead of that entry.
"""

import torch
import triton

from lorapool.kernels import jit, tuned

MAX_SPLITS = 32
OP = "paged_attention"  # the op's name in kernels/configs/<device>.json
CONFIG_KEYS = ("block_n", "num_splits", "num_warps", "num_stages")


def config_key(
    num_tokens: int,
    num_seqs: int,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    max_context: int,
    dtype: torch.dtype,
) -> str:
    """The tuned-config key of a call: decode or prefill, heads, head size, dtype, and
    the tokens and the block table's reach rounded up to powers of two (a CUDA graph's
    decode step reaches ``max_model_len``)."""
    kind = "decode" if num_tokens <= num_seqs else "prefill"
    name = str(dtype).removeprefix("torch.")
    tokens, reach = triton.next_power_of_2(num_tokens), triton.next_power_of_2(max_context)
    return f"{kind}-h{num_heads}-kv{num_kv_heads}-d{head_size}-{name}-t{tokens}-c{reach}"


def candidates(block_q: int = 1) -> list[dict]:
    """Launch configs the GPU kit's sweep tries (a handful: the sweep must stay short)."""
    out = []
    for block_n in (32, 64, 128):
        for num_warps in (4, 8):
            for num_splits in (1, 4, 16) if block_q == 1 else (1,):
                out.append({"block_n": block_n, "num_warps": num_warps, "num_splits": num_splits})
    return out


def heuristic(query, block_q: int, num_programs: int, max_context: int, block_size: int) -> dict:
    """Today's launch: BLOCK_N 64 (32 in fp32: less shared memory), splits to fill the device."""
    block_n = max(32 if query.dtype == torch.float32 else 64, block_size)
    num_splits, _ = kv_splits(num_programs, block_q, max_context, block_n, query.device)
    return {"block_n": block_n, "num_splits": num_splits}


def tuned_config(device: torch.device, key: str) -> dict:
    if device.type != "cuda":
        return {}
    return checked(tuned.lookup(device, OP, key) or {})


def checked(config: dict) -> dict:
    unknown = set(config) - set(CONFIG_KEYS)
    if unknown:
        raise ValueError(f"unknown paged_attention config keys {sorted(unknown)}")
    return dict(config)


def kv_splits(
    num_programs: int, block_q: int, max_context: int, block_n: int, device: torch.device
) -> tuple[int, int]:
    """(splits, positions per split) of each sequence's context (flash-decoding).

    Decode has one program per token and KV head: too few to fill the device
    for a small batch, and each walks the whole context. Splitting the context
    over programs, whose partial softmax results a second kernel combines,
    restores the parallelism. Prefill has enough query blocks; it never splits.
    """
    target = 2 * jit.num_sms(device) if device.type == "cuda" else 16
    splits = min(target // num_programs, triton.cdiv(max_context, 256), MAX_SPLITS)
    if block_q > 1 or splits < 2:
        return 1, max_context
    return splits, triton.cdiv(triton.cdiv(max_context, splits), block_n) * block_n
