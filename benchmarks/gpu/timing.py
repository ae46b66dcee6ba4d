"""Timing on either device: CUDA events on a GPU, the wall clock on the CPU."""

from __future__ import annotations

import statistics
import time

import torch


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_call(fn, device: str, reps: int = 5, warmup: int = 1) -> float:
    """Median seconds of ``fn()`` over ``reps`` calls after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1000)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


class Stopwatch:
    """Wall seconds of a block, the device synchronized at both ends."""

    def __init__(self, device: str):
        self.device, self.seconds = device, 0.0

    def __enter__(self):
        sync(self.device)
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        sync(self.device)
        self.seconds = time.perf_counter() - self.t0
