"""The worker's appends, sent on a thread of their own while the engine steps on.

One batch is on its way at a time, in the order handed over: chunk ``seq`` order
per request, and so the fencing of ``scripts.APPEND``, is as if sent inline. The
worker hands a batch over only when the previous one is done (``idle``), and
applies the results on its own thread (``take_done``): every piece of state a
result changes is the worker's, touched by one thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


class Sender:
    def __init__(self, send: Callable[[list], list], name: str):
        self._send = send
        self._cond = threading.Condition()
        self._batch: list | None = None  # handed over, its send not finished
        self._done: list[tuple[list, Any]] = []  # (batch, results or the exception)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"sender-{name}", daemon=True)

    @property
    def idle(self) -> bool:
        return self._batch is None

    def hand(self, batch: list) -> None:
        with self._cond:
            if self._batch is not None:
                raise RuntimeError("a batch is still on its way")
            self._batch = batch
            self._cond.notify_all()
        if self._thread.ident is None:  # started with the first batch
            self._thread.start()

    def wait(self) -> None:
        """Until the batch on its way is sent (or failed)."""
        with self._cond:
            self._cond.wait_for(lambda: self._batch is None)

    def take_done(self) -> list[tuple[list, Any]]:
        with self._cond:
            done, self._done = self._done, []
        return done

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._batch is not None or self._closed)
                if self._batch is None:
                    return
                batch = self._batch
            try:
                result: Any = self._send(batch)
            except BaseException as exc:  # noqa: BLE001 - handed to the worker's thread
                result = exc
            with self._cond:
                self._done.append((batch, result))
                self._batch = None
                self._cond.notify_all()
