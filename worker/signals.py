"""The worker's SIGTERM/SIGINT: the first drains, the second hands entries back
(``Worker.on_signal``); installed for the worker's run, restored after it."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from typing import Any


def install(on_signal: Callable[[], None]) -> dict[int, Any]:
    """Call ``on_signal`` on SIGTERM/SIGINT (main thread only: elsewhere nothing is
    installed); returns the old handlers, for ``restore``."""
    saved: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGTERM, signal.SIGINT):
            saved[signum] = signal.signal(signum, lambda signum, frame: on_signal())
    return saved


def restore(saved: dict[int, Any]) -> None:
    """Put back the handlers ``install`` replaced (and forget them)."""
    for signum, handler in saved.items():
        signal.signal(signum, handler)
    saved.clear()
