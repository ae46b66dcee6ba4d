"""Section 1: the device, its driver, the software's versions, and the copy bandwidth.

The copy bandwidth (a device-to-device ``copy_`` of ``copy_bytes``, bytes read
plus bytes written over the median time) is the roofline the later sections
measure against: the kernels' achieved bandwidth and the decode step's floor.
The host-to-device bandwidth from pinned memory is what an adapter swap gets.
"""

from __future__ import annotations

import platform
import subprocess
import sys
from importlib import metadata

import torch

from .timing import time_call

PACKAGES = ("torch", "triton", "transformers", "peft", "safetensors", "tokenizers", "redis")


def run(ctx, rec) -> None:
    device = ctx.device
    rec.figure("python", platform.python_version())
    for name in PACKAGES:
        rec.figure(name, _version(name))
    rec.figure("torch_cuda", torch.version.cuda or "none")
    if device == "cuda":
        _cuda_device(rec)
    else:
        rec.figure("device_name", platform.processor() or platform.machine())
        rec.figure("cpu_threads", torch.get_num_threads())
    _bandwidth(ctx, rec)


def _cuda_device(rec) -> None:
    props = torch.cuda.get_device_properties(0)
    rec.figure("device_name", props.name)
    rec.figure("capability", f"sm_{props.major}{props.minor}")
    rec.figure("multiprocessors", props.multi_processor_count)
    free, total = torch.cuda.mem_get_info()
    rec.figure("memory_total_GiB", round(total / 2**30, 2))
    rec.figure("memory_free_GiB", round(free / 2**30, 2))
    rec.figure("driver", _driver())
    rec.check("device is CUDA", torch.cuda.is_available(), props.name)


def _driver() -> str:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        return out.stdout.strip() or out.stderr.strip()[:200]
    except (OSError, subprocess.SubprocessError) as exc:
        return f"unknown ({exc})"


def _bandwidth(ctx, rec) -> None:
    device, nbytes = ctx.device, ctx.sizes.copy_bytes
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    seconds = time_call(lambda: dst.copy_(src), device, reps=10, warmup=3)
    copy_gbps = 2 * nbytes / seconds / 1e9
    rec.figure("copy_GBps", round(copy_gbps, 1))
    rec.check("copy is exact", torch.equal(src, dst))
    rec.check("copy bandwidth is positive and finite", 0 < copy_gbps < 1e5, f"{copy_gbps:.1f}")
    if device == "cuda":
        host = torch.empty(nbytes // 4, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(nbytes // 4, dtype=torch.uint8, device=device)
        seconds = time_call(lambda: dev.copy_(host, non_blocking=True), device, reps=5)
        rec.figure("h2d_pinned_GBps", round(nbytes / 4 / seconds / 1e9, 1))


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        module = sys.modules.get(name)
        return getattr(module, "__version__", "not installed")
