"""The worker's SIGTERM/SIGINT: the first drains, the second hands entries back."""

from __future__ import annotations

import logging
import signal
import threading
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lorapool.worker.worker import Worker

logger = logging.getLogger(__name__)


def install(worker: Worker) -> None:
    """Flag the worker on SIGTERM/SIGINT (main thread only); the old handlers are kept
    in ``worker._saved_signals`` for ``restore``."""
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGTERM, signal.SIGINT):
            handler = lambda signum, frame: on_sigterm(worker)  # noqa: E731
            worker._saved_signals[signum] = signal.signal(signum, handler)


def restore(worker: Worker) -> None:
    for signum, handler in worker._saved_signals.items():
        signal.signal(signum, handler)
    worker._saved_signals.clear()


def on_sigterm(worker: Worker) -> None:
    """Only flags: the loop acts on them between steps, never inside a Redis call."""
    if not worker.draining:
        logger.info("worker %s: draining (again to hand entries back)", worker.name)
        worker.draining = True
        worker._drain_deadline = time.monotonic() + worker.config.drain_timeout_s
    else:
        logger.info("worker %s: handing entries back", worker.name)
        worker._drain_deadline = 0.0  # the loop hands back and stops at once
