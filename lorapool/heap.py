"""The garbage collector while a worker or a gateway process serves.

Each chunk allocates a few short-lived containers (a step's outputs, the chunk,
its wire record), and CPython's default first-generation threshold (700
allocations) then runs a collection every few dozen chunks, each scanning the
young objects that are still alive: the requests held, their kept chunks. At 256
sequences that was ~2 µs of a worker's ~13 µs of CPU a token (``bench queue-path``
with each collection timed; benchmarks/RESULTS.md). While serving, the heap's long-lived part (the
model, modules, the engine) is frozen out of collections (``gc.freeze``, after a
full collection) and the first generation waits for ``GEN0_THRESHOLD``
allocations: most chunk garbage is freed by reference counting before a
collection ever sees it. The worker makes few reference cycles; those it makes are
still collected, later. ``serve`` (the ``lorapool worker`` process) does this
around the worker's run, once the engine is built; ``restore`` puts the settings
back. (A worker run inside a test process does not: its full collection alone, with
torch loaded, takes ~0.1 s.)

The gateway (``GatewayServer``, once its app has started) does the same: its heap
(transformers, FastAPI, pydantic, the app) took a full collection of ~35 ms every ~2 s
while a hostile tenant's flood allocated, each holding the event loop, and other
tenants' calls waited through it (issue 51's p99; benchmarks/RESULTS.md).

May import: the standard library.
"""

from __future__ import annotations

import gc

GEN0_THRESHOLD = 20_000


def quiet() -> tuple[int, int, int]:
    """Freeze what is alive now and raise the first generation's threshold; returns
    the thresholds to ``restore``."""
    saved = gc.get_threshold()
    gc.collect()
    gc.freeze()
    gc.set_threshold(max(GEN0_THRESHOLD, saved[0]), *saved[1:])
    return saved


def restore(saved: tuple[int, int, int]) -> None:
    gc.set_threshold(*saved)
    gc.unfreeze()
