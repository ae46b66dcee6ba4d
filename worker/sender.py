"""The worker's round trips to Redis, made on a thread of their own while the engine
steps on.

One trip is on its way at a time, in the order handed over: chunk ``seq`` order
per request, and so the fencing of ``lifecycle.append``, is as if sent inline. A
trip is handed over (``hand``), never shared: what it carries is the sender's
thread's until the worker's thread takes it back with its results (``take_done``),
and ``hand`` refuses a trip while one is on its way or a finished one is not yet
taken back. (What that means for a request's ``Held``: ``publisher.py``.) The lease
and the heartbeat do not ride it: they have a thread of their own (``renewer.py``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


class Sender:
    def __init__(self, send: Callable[[Any], Any], name: str):
        self._send = send
        self._cond = threading.Condition()
        self._trip: Any = None  # the trip handed over, until its send is finished
        self._done: list[tuple[Any, Any]] = []  # (trip, results or the exception)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"sender-{name}", daemon=True)

    @property
    def idle(self) -> bool:
        return self._trip is None

    def hand(self, trip: Any) -> None:
        with self._cond:
            if self._trip is not None:
                raise RuntimeError("a trip is still on its way")
            if self._done:
                raise RuntimeError("a finished trip is not taken back yet (take_done)")
            self._trip = trip
            self._cond.notify_all()
        if self._thread.ident is None:  # started with the first trip
            self._thread.start()

    def wait(self) -> None:
        """Until the trip on its way is sent (or failed)."""
        with self._cond:
            self._cond.wait_for(lambda: self._trip is None)

    def take_done(self) -> list[tuple[Any, Any]]:
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
        while (trip := self._next_trip()) is not None:
            try:
                result: Any = self._send(trip)
            except BaseException as exc:  # noqa: BLE001 - handed to the worker's thread
                result = exc
            with self._cond:
                self._done.append((trip, result))
                self._trip = None
                self._cond.notify_all()

    def _next_trip(self) -> Any:
        """The trip handed over; None once closed."""
        with self._cond:
            self._cond.wait_for(lambda: self._trip is not None or self._closed)
            return self._trip
