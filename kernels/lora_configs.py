"""Launch configurations of the LoRA kernels (``lora_ops``): tuned key, sweep space, choice.

A configuration is a dict of some of the fields of its op:

    lora_shrink: BLOCK_K, SPLIT_K, num_warps, num_stages
    lora_expand: BLOCK_N, num_warps, num_stages
    lora_linear: BLOCK_K, SPLIT_K, BLOCK_N, num_warps, num_stages (both kernels' warps
                 and stages)

A wrapper's ``config=None`` means: the device's measured entry for the op at
``config_key`` of the call (``kernels.tuned.lookup``), else the heuristics of
``lora_ops``; a field a dict leaves out comes from the heuristics too.

Key format: ``t{T}-h{H_in}-r{R}-s{S}-w{n_1}_{n_2}...`` with T, the tokens of the
call, rounded up to a power of two (a CUDA graph's calls have T = its bucket
size), H_in the input width, R the rank of the call (the step's rank, or
``max_lora_rank`` in a graph), S the slices and n_s their output widths. The
expand has no H_in and the shrink no widths: those parts are left out
(``t16-r16-s3-w4096_1024_1024``, ``t16-h4096-r16-s3``).
"""

import itertools

import triton

from lorapool.kernels import jit, tuned

FIELDS = {
    "lora_shrink": ("BLOCK_K", "SPLIT_K", "num_warps", "num_stages"),
    "lora_expand": ("BLOCK_N", "num_warps", "num_stages"),
    "lora_linear": ("BLOCK_K", "SPLIT_K", "BLOCK_N", "num_warps", "num_stages"),
}
# What a sweep tries per field (``candidates``); the heuristics' choices at model shapes
# (H_in >= 32; Triton's default num_warps 4, num_stages 3) are among them.
SPACE = {
    "BLOCK_K": (32, 64, 128, 256),
    "SPLIT_K": (1, 2, 4, 8),
    "BLOCK_N": (32, 64, 128),
    "num_warps": (4, 8),
    "num_stages": (2, 3),
}


def config_key(
    num_tokens: int, rank: int, num_slices: int, hidden: int | None = None, widths=None
) -> str:
    """The ``kernels.tuned`` key of a call's shape (module docstring)."""
    parts = [f"t{triton.next_power_of_2(max(num_tokens, 1))}"]
    if hidden is not None:
        parts.append(f"h{hidden}")
    parts += [f"r{rank}", f"s{num_slices}"]
    if widths is not None:
        parts.append("w" + "_".join(str(int(w)) for w in widths))
    return "-".join(parts)


def candidates(op: str, hidden: int | None = None, widths=None) -> list[dict]:
    """Every configuration of ``op`` a sweep should time, each a full dict of its fields.

    ``hidden`` (shrink, lora_linear) drops blocks wider than H_in and more splits than
    it has K blocks; ``widths`` (expand, lora_linear) drops column blocks wider than
    the widest slice. At most 64 (shrink), 12 (expand), 192 (lora_linear) dicts.
    """
    fields = FIELDS[op]
    space = dict(SPACE)
    if hidden is not None:
        space["BLOCK_K"] = [b for b in SPACE["BLOCK_K"] if b <= jit.next_pow2(hidden, 32)]
    if widths is not None:
        space["BLOCK_N"] = [b for b in SPACE["BLOCK_N"] if b <= jit.next_pow2(max(widths), 32)]
    found = []
    for values in itertools.product(*(space[f] for f in fields)):
        cfg = dict(zip(fields, values))
        if hidden is not None and cfg.get("SPLIT_K", 1) > triton.cdiv(hidden, cfg["BLOCK_K"]):
            continue  # splits past the last K block would sum nothing
        found.append(cfg)
    return found


def resolve(op: str, config: dict | None, device, **shape) -> dict:
    """The call's configuration: ``config``, else the device's tuned entry, else {};
    checked. ``shape``: ``config_key``'s arguments, read only when a lookup is made."""
    if config is None and device.type == "cuda":
        config = tuned.lookup(device, op, config_key(**shape))
    config = dict(config or {})
    unknown = set(config) - set(FIELDS[op])
    if unknown:
        raise ValueError(f"{op} config has unknown fields {sorted(unknown)}; {FIELDS[op]} known")
    for name, value in config.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{op} config {name} must be a positive int, got {value!r}")
        if name.startswith("BLOCK_") and (value < 16 or value & (value - 1)):
            raise ValueError(f"{op} config {name} must be a power of two >= 16, got {value}")
    return config


def launch_options(config: dict) -> dict:
    """The Triton launch options (not kernel arguments) of a configuration."""
    return {k: config[k] for k in ("num_warps", "num_stages") if k in config}
