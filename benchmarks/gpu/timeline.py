"""Where a decode step's time goes: host phases and the GPU's time, step by step.

``StepTimeline`` wraps, on one engine's own objects (nothing in the engine
changes), the calls a step makes in order: the scheduler's ``schedule``, the
runner's ``prepare`` and ``execute``, the sampler and the output processor's
``make_output``. Each is timed by the wall clock on the host; ``execute`` also
gets CUDA events on either side, whose interval is the GPU's time for the
forward (``gpu``: the replay or the eager kernels, launch gaps included). What
the wrapped calls leave of a step's wall time is ``other`` (the engine's own
bookkeeping, LoRA activation, logits processing), so the phases add up to the
step: ``step = schedule + prepare + execute + sample + output + other``; the
sampler waits for the GPU, so ``execute + sample`` holds the GPU's time. A
wrapped call that an engine lacks (a refactor) is left out and lands in ``other``.
"""

from __future__ import annotations

import statistics
import time

import torch

PHASES = ("schedule", "prepare", "execute", "sample", "output")
_TARGETS = {  # phase -> (object path from the engine, attribute)
    "schedule": ("scheduler", "schedule"),
    "prepare": ("runner", "prepare"),
    "execute": ("runner", "execute"),
    "sample": ("", "sampler"),
    "output": ("outputs", "make_output"),
}


class StepTimeline:
    def __init__(self, engine, device: str):
        self.engine, self.cuda = engine, device == "cuda"
        self.saved: list[tuple[object, str, object]] = []
        self.current: dict[str, float] = {}
        self.events: list = []
        self.steps: list[dict[str, float]] = []
        self.gpu_events: list = []  # (a kept step's phases, its forwards' events)

    def __enter__(self):
        for phase, (path, attr) in _TARGETS.items():
            owner = getattr(self.engine, path, None) if path else self.engine
            original = getattr(owner, attr, None) if owner is not None else None
            if original is None:
                continue
            self.saved.append((owner, attr, owner.__dict__.get(attr)))
            timed = self._timed(phase, original)
            if not callable(getattr(original, "__func__", None)):  # an object (the sampler)
                timed = _Proxy(original, timed)  # its other attributes still answer
            setattr(owner, attr, timed)
        return self

    def __exit__(self, *exc):
        self.settle()
        for owner, attr, before in reversed(self.saved):
            if before is None:
                delattr(owner, attr)  # the class's method shows through again
            else:
                setattr(owner, attr, before)

    def _timed(self, phase: str, fn):
        def timed(*args, **kwargs):
            if phase == "execute" and self.cuda:
                start, end = (
                    torch.cuda.Event(enable_timing=True),
                    torch.cuda.Event(enable_timing=True),
                )
                start.record()
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.current[phase] = self.current.get(phase, 0.0) + time.perf_counter() - t0
                if phase == "execute" and self.cuda:
                    end.record()
                    self.events.append((start, end))

        return timed

    def step(self, keep: bool):
        """Run one engine step; ``keep``: count it (a step in which every sequence decodes)."""
        self.current, self.events = {}, []
        t0 = time.perf_counter()
        outputs = self.engine.step()
        wall = time.perf_counter() - t0
        if keep:
            phases = {p: self.current.get(p, 0.0) for p in PHASES}
            phases["other"] = wall - sum(phases.values())
            phases["step"] = wall
            if self.events:  # read at the end: a sync here would end the step's overlap
                self.gpu_events.append((phases, self.events))
            self.steps.append(phases)
        return outputs

    def settle(self) -> None:
        """The kept steps' GPU times, once their events have passed (one sync, after the
        last step: syncing after each would wait for the step that async scheduling
        leaves in flight, which the next step's host work overlaps)."""
        if self.gpu_events:
            torch.cuda.synchronize()
        for phases, events in self.gpu_events:
            phases["gpu"] = sum(s.elapsed_time(e) / 1000 for s, e in events)
        self.gpu_events = []

    def summary(self, skip: int = 2) -> dict[str, float]:
        """Each phase's mean milliseconds over the kept steps (the first ``skip`` dropped):
        means, so that the phases add up to the mean step."""
        steps = self.steps[skip:] or self.steps
        if not steps:
            return {}
        keys = [k for k in (*PHASES, "other", "gpu", "step") if k in steps[0]]
        return {f"{k}_ms": round(statistics.fmean(s[k] for s in steps) * 1e3, 3) for k in keys}


class _Proxy:
    """An object whose calls are timed; every other attribute is the object's own."""

    def __init__(self, target, timed_call):
        self._target, self._timed_call = target, timed_call

    def __call__(self, *args, **kwargs):
        return self._timed_call(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._target, name)
