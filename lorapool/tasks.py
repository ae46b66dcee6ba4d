"""Ending asyncio tasks for sure.

On Python 3.10 and 3.11, ``asyncio.wait_for`` returns its inner future's result when a
cancel reaches the waiting task in the same turn of the loop as that future completes,
and the task runs on as if nothing had happened (CPython gh-86296; 3.12's rewrite fixed
it). redis-py's asyncio client waits that way around its writes and reads, and so do
loops of ours: a task cancelled while its Redis command completed went on reading, and
whoever awaited its end waited forever (a gateway stream that never ended, a gateway
that never stopped). :func:`cancel_and_wait` cancels again until the task has ended.
"""

from __future__ import annotations

import asyncio
import logging

logger = logging.getLogger(__name__)
RECANCEL_S = 0.1  # a task still running this long after a cancel is cancelled again


async def cancel_and_wait(*tasks: asyncio.Future, every_s: float = RECANCEL_S) -> None:
    """Cancel ``tasks`` and return once every one has ended, cancelling those still
    running every ``every_s``. Their results and errors are dropped (retrieved: asyncio
    logs none of them). A cancel of the caller itself is not absorbed: it raises here,
    the tasks left cancelled."""
    pending = {task for task in tasks if not task.done()}
    while pending:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=every_s)
    for task in tasks:
        if not task.cancelled():
            task.exception()


_FINISHING: set[asyncio.Task] = set()  # a task runs to its end only while referenced


async def finish(coro) -> None:
    """Run ``coro`` to its end whatever happens to the caller: in a task of its own,
    awaited shielded. A cleanup in a ``finally`` needs it when the caller may be
    cancelled again while it waits (``cancel_and_wait`` re-cancels every 0.1 s, and so
    does anyio): the cleanup's own ``cancel_and_wait`` of the task it ends was cut short
    there, and that task, whose first cancel CPython had lost (gh-86296), ran on for
    good. The caller's cancel still raises here; the cleanup goes on without it."""
    task = asyncio.ensure_future(coro)
    _FINISHING.add(task)
    task.add_done_callback(_finished)
    await asyncio.shield(task)


def _finished(task: asyncio.Task) -> None:
    """Drops the reference; a failure is retrieved (one debug line), not left for
    asyncio's "exception was never retrieved" traceback when no caller awaits it any
    more (a caller that does still gets it raised)."""
    _FINISHING.discard(task)
    if not task.cancelled() and (error := task.exception()) is not None:
        logger.debug("cleanup %r failed: %s", task.get_coro(), error)
