"""How many bytes the KV cache gets on a GPU: vLLM's ``gpu_memory_utilization`` rule.

The engine may hold ``utilization`` of the device's memory. What is in use
when the cache is sized (the weights, the CUDA context, other processes on
the device: ``total - free`` from ``torch.cuda.mem_get_info``) and a reserve
for the largest step's activations come off that share; the cache gets the
rest. vLLM measures the activations with a profiling forward pass; the
reserve here is an estimate from the model's shape, an upper bound of what
one step of ``max_num_batched_tokens`` tokens holds at once (checked by the
GPU kit, ``lorapool bench gpu``, which reports the memory used after sizing).
"""

from __future__ import annotations

from lorapool.engine.warpers import TOP_P_SORT_BYTES

SLACK_BYTES = 256 << 20  # the allocator's fragmentation, cuBLAS workspaces, graphs' pool


def activation_reserve(args, max_num_batched_tokens: int, max_num_seqs: int, itemsize: int) -> int:
    """Bytes one step's activations may need at their peak.

    ``args``: the model's ``ModelArgs``. Per token, within a layer: the residual and
    normed hidden states, the packed q/k/v, the attention output, gate/up and the
    activated product (in the model's dtype), twice for temporaries that overlap.
    Per sampled row: the logits in the model's dtype and two float32 copies
    (the float logits and the sampler's probabilities); and the sync-free top-p's
    workspace (``warpers.TOP_P_SORT_BYTES``: rows sorted whole, a chunk at a time).
    """
    qkv = (args.num_heads + 2 * args.num_kv_heads) * args.head_dim
    per_token = (4 * args.hidden_size + qkv + args.num_heads * args.head_dim) * itemsize
    per_token += 3 * args.intermediate_size * itemsize
    per_row = args.vocab_size * (itemsize + 8)
    rows = max_num_seqs * per_row + TOP_P_SORT_BYTES
    return 2 * max_num_batched_tokens * per_token + rows + SLACK_BYTES


def kv_cache_budget(free: int, total: int, utilization: float, reserve: int) -> int:
    """Bytes for the KV cache: ``utilization * total`` less what is used and ``reserve``.

    Raises ValueError, saying what to change, when nothing is left.
    """
    if not 0 < utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization!r}")
    used = total - free
    budget = int(total * utilization) - used - reserve
    if budget <= 0:
        gib = 2**30
        raise ValueError(
            f"no GPU memory left for the KV cache: gpu_memory_utilization={utilization} allows "
            f"{total * utilization / gib:.2f} GiB, {used / gib:.2f} GiB are in use (weights, "
            f"other processes) and {reserve / gib:.2f} GiB are kept for activations; raise "
            "gpu_memory_utilization, lower max_num_batched_tokens or max_num_seqs, or set "
            "kv_cache_memory"
        )
    return budget
