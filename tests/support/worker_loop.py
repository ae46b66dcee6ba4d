"""A real ``Worker``'s loop run on a thread while a test reads (``looping``): since issue 48
the workers, not the readers, end a request whose entry was removed, so a reader waiting
for that end needs a worker alive, as in a pool."""

from __future__ import annotations

import contextlib
import threading


@contextlib.contextmanager
def looping(worker):
    """Run ``worker.run_guarded()`` over and over on a thread until the block ends."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            worker.run_guarded()

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield worker
    finally:
        stop.set()
        thread.join(30)
        assert not thread.is_alive(), "the worker's loop did not stop"
