"""glibc's malloc, tuned for a forward pass on the CPU.

A CPU step allocates and frees tensors of many megabytes: the activations of a
2,048-token prefill chunk (25 MB for one gate/up output), and in decode the
K/V that attention gathers for every layer (27 MB each for 64 sequences of
540 tokens). With glibc's defaults, a block above the mmap threshold (128 KiB,
raised on the fly to at most 32 MiB) is a fresh ``mmap`` and memory freed at
the top of the heap goes back to the kernel past the trim threshold, so every
step page-faults its way through memory it has just given back. Raising both
thresholds keeps that memory in the heap from one step to the next: a
64-sequence decode step of SmolLM2 ran in 408 ms instead of 947 ms
(benchmarks/RESULTS.md, "Host allocator").

The setting is process-wide, as the allocator is. It is what an inference
process wants (the engine is the process's main tenant) and costs at most
``TRIM_THRESHOLD`` of freed memory held back from the kernel. Other C
libraries (musl) and other allocators preloaded in its place (jemalloc,
tcmalloc) are left as they are.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import platform

logger = logging.getLogger(__name__)

# mallopt(3) parameters
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3

MMAP_THRESHOLD = 64 << 20  # blocks this large or larger still get their own mapping
TRIM_THRESHOLD = 256 << 20  # free memory the heap may keep at its top
TOP_PAD = 64 << 20  # grow the heap in steps this large


def tune_host_allocator() -> bool:
    """Raise glibc's mmap and trim thresholds for this process; True if it took.

    Returns False, changing nothing, where the C library is not glibc.
    """
    if platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return False
    settings = (
        (_M_MMAP_THRESHOLD, MMAP_THRESHOLD),
        (_M_TRIM_THRESHOLD, TRIM_THRESHOLD),
        (_M_TOP_PAD, TOP_PAD),
    )
    ok = all(libc.mallopt(param, value) == 1 for param, value in settings)
    logger.info("host allocator: mmap threshold %d MiB (%s)", MMAP_THRESHOLD >> 20, ok)
    return ok
