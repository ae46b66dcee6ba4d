"""Server-sent events: the framing, and several jobs' chunks merged into one stream."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import orjson

from lorapool.producer import AsyncJobHandle
from lorapool.records.chunk import Chunk
from lorapool.tasks import cancel_and_wait, finish

DONE = b"data: [DONE]\n\n"


# Characters that JSON leaves raw but that str.splitlines() ends a line at: clients that
# read a stream with httpx's or requests' iter_lines() would cut a data line there
# (a model's text holds them now and then). Escaped, they decode to the same string.
_LINE_ENDS = (
    (b"\xc2\x85", b"\\u0085"),
    (b"\xe2\x80\xa8", b"\\u2028"),
    (b"\xe2\x80\xa9", b"\\u2029"),
)


def sse(data: Any, event: str | None = None, event_id: int | None = None) -> bytes:
    """One SSE event; ``data`` is JSON-encoded: no raw newline reaches the frame, nor
    any other character that ``str.splitlines`` takes for a line's end (``_LINE_ENDS``)."""
    head = b""
    if event_id is not None:
        head += b"id: %d\n" % event_id
    if event is not None:
        head += b"event: " + event.encode() + b"\n"
    body = orjson.dumps(data)
    if not body.isascii():  # most events: one fast check (UTF-8 is self-synchronising)
        for raw, escaped in _LINE_ENDS:
            if raw in body:
                body = body.replace(raw, escaped)
    return head + b"data: " + body + b"\n\n"


async def merged_chunks(
    handles: list[AsyncJobHandle], kept: set[str] | None = None
) -> AsyncIterator[tuple[int, Chunk]]:
    """(handle index, chunk) of every handle as they come, each handle's in order,
    until every one has given its final chunk. Unfinished jobs are aborted when the
    reader goes away (the client disconnected), except those whose request id is in
    ``kept`` by then."""
    if len(handles) == 1:
        async for chunk in guarded(handles[0], kept=kept):
            yield 0, chunk
        return
    queue: asyncio.Queue = asyncio.Queue()
    tasks = [asyncio.create_task(_feed(i, h, queue, kept)) for i, h in enumerate(handles)]
    try:
        for _ in handles:
            while (item := await queue.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                yield item
    finally:  # ended, not only cancelled: one that swallowed it would follow on forever
        await cancel_and_wait(*tasks)


async def _feed(index: int, handle: AsyncJobHandle, queue: asyncio.Queue, kept) -> None:
    try:
        async for chunk in guarded(handle, kept=kept):
            await queue.put((index, chunk))
    except Exception as exc:  # noqa: BLE001 - handed to the reader
        await queue.put(exc)
    await queue.put(None)


async def until_stopped(
    items: AsyncIterator, stopping: asyncio.Event, max_s: float | None = None
) -> AsyncIterator:
    """``items`` until they end, ``stopping`` is set (the gateway shutting down) or
    ``max_s`` seconds have passed: the response then ends cleanly, and an EventSource
    reconnects (to this gateway or another) with Last-Event-ID."""
    stop = asyncio.ensure_future(stopping.wait())
    deadline = None if max_s is None else time.monotonic() + max_s
    step = None
    try:
        while True:
            step = asyncio.ensure_future(items.__anext__())
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            await asyncio.wait({step, stop}, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            if not step.done():
                await cancel_and_wait(step)  # then it may be closed
                return
            try:
                yield step.result()
            except StopAsyncIteration:
                return
    finally:
        stop.cancel()
        await _close(items, step)


async def _close(items: AsyncIterator, step: asyncio.Future | None) -> None:
    """Close ``items`` once ``step``, a task running its ``__anext__``, has ended: an
    async generator cannot be closed while it runs (``aclose()`` raised "asynchronous
    generator is already running" at every client that left a waiting stream, and the
    step ran on, holding its job's reads). Finished in a task of its own: the cancel
    that brought the caller here (Starlette's at a disconnect, a pump's
    ``cancel_and_wait``) comes again every 0.1 s, and an anyio shield does not stop a
    plain asyncio cancel: a step whose first cancel was lost ran on, its job's channel
    subscribed for good (CI, ``test_row6_leaving_waiting_openai_streams_is_quiet_too``)."""
    await finish(_end(items, step))


async def _end(items: AsyncIterator, step: asyncio.Future | None) -> None:
    if step is not None:
        await cancel_and_wait(step)
    await items.aclose()


async def guarded(
    handle: AsyncJobHandle, after: int = -1, abort: bool = True, kept: set[str] | None = None
) -> AsyncIterator[Chunk]:
    """The handle's chunks after seq ``after``; the job is aborted if the reader stops
    before the final one (unless not ``abort``: a job's events reader may come back; or
    its request id is in ``kept`` by then: a job left queued for a worker to come)."""
    finished = not abort
    try:
        async for chunk in handle.chunks(after=after):
            finished = finished or chunk.finished
            yield chunk
    finally:
        if not finished and handle.request_id not in (kept or ()):
            await finish(handle.abort())  # the abort sent though the reader is cancelled again


async def until_taken(items: AsyncIterator, watch: asyncio.Future) -> AsyncIterator:
    """``items``; if ``watch`` (``Pool.untaken``) raises before the first item comes,
    that error instead. ``watch`` is cancelled at the first item or the end."""
    step = None
    try:
        step = asyncio.ensure_future(items.__anext__())
        await asyncio.wait({step, watch}, return_when=asyncio.FIRST_COMPLETED)
        if not step.done():
            await cancel_and_wait(step)
            watch.result()  # raises its error
        try:
            first = step.result()
        except StopAsyncIteration:
            return
        watch.cancel()
        yield first
        async for item in items:
            yield item
    finally:
        watch.cancel()
        await _close(items, step)
