"""cancel_and_wait ends a task that swallowed a cancel, and the gateway's waits that use
it end with it (CPython gh-86296: on 3.10 and 3.11 ``asyncio.wait_for`` swallows a
cancel that lands in the turn its inner future completes; redis-py's commands wait that
way). The oracle is asyncio itself: the same task awaited the old way does not end."""

from __future__ import annotations

import asyncio
import contextlib
import sys

import pytest

from lorapool.gateway.streams import until_stopped, until_taken
from lorapool.openai.errors import APIError
from lorapool.tasks import cancel_and_wait


async def _swallows_one_cancel(ran: list) -> None:
    """What a task that lost a cancel to wait_for does: it runs on, and only a second
    cancel ends it."""
    try:
        await asyncio.sleep(30)
    except asyncio.CancelledError:
        ran.append("swallowed")
    await asyncio.sleep(30)


async def _ends_within(awaitable, seconds: float) -> bool:
    try:
        await asyncio.wait_for(asyncio.shield(asyncio.ensure_future(awaitable)), seconds)
    except asyncio.TimeoutError:
        return False
    return True


def test_a_task_that_swallowed_a_cancel_is_cancelled_again_until_it_ends():
    async def main():
        ran: list = []
        task = asyncio.ensure_future(_swallows_one_cancel(ran))
        await asyncio.sleep(0)
        task.cancel()  # the old way: one cancel, then wait for the end
        assert not await _ends_within(asyncio.gather(task, return_exceptions=True), 0.5)
        assert ran == ["swallowed"] and not task.done()
        await asyncio.wait_for(cancel_and_wait(task), 2)
        assert task.cancelled()

    asyncio.run(main())


def test_the_wait_for_race_itself_is_ended():
    """The race as CPython has it: the task is cancelled in the turn the future it waits
    for through wait_for completes. On 3.10-3.11 the cancel is lost; either way
    cancel_and_wait ends the task."""

    async def main():
        done = asyncio.get_running_loop().create_future()
        after: list = []

        async def reader():
            got = await asyncio.wait_for(done, 10)
            after.append(got)  # reached only when the cancel was swallowed
            while True:
                await asyncio.sleep(0.01)

        task = asyncio.ensure_future(reader())
        await asyncio.sleep(0)  # the reader waits in wait_for
        done.set_result("answer")
        task.cancel()  # the same turn
        await asyncio.sleep(0.05)
        assert (after == ["answer"]) == (sys.version_info < (3, 12))
        await asyncio.wait_for(cancel_and_wait(task), 2)
        assert task.done()

    asyncio.run(main())


def test_results_and_errors_are_dropped_and_a_done_task_is_left_as_it_is():
    async def main():
        async def fails():
            raise ValueError("boom")

        failed, finished = asyncio.ensure_future(fails()), asyncio.ensure_future(asyncio.sleep(0))
        await asyncio.sleep(0.01)
        await cancel_and_wait(failed, finished)  # returns; raises nothing
        assert isinstance(failed.exception(), ValueError) and finished.result() is None

    asyncio.run(main())


def test_a_cancel_of_the_caller_is_not_absorbed():
    async def main():
        release = asyncio.Event()

        async def deaf():  # swallows every cancel until released
            while not release.is_set():
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.sleep(30)

        stubborn = asyncio.ensure_future(deaf())
        await asyncio.sleep(0)
        waiting = asyncio.ensure_future(cancel_and_wait(stubborn, every_s=0.01))
        await asyncio.sleep(0.05)  # cancelled again and again meanwhile: it runs on
        assert not waiting.done() and not stubborn.done()
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        release.set()
        await asyncio.wait_for(cancel_and_wait(stubborn), 2)
        assert stubborn.done()

    asyncio.run(main())


async def _items_that_swallow_a_cancel():
    """A stream of chunks whose read swallows the cancel of its step once, as the
    follower's Redis read did, and then waits on (no worker: no chunk ever comes)."""
    ran: list = []
    await _swallows_one_cancel(ran)
    yield "never"


def test_until_taken_ends_with_the_no_worker_error_though_the_read_swallowed_the_cancel():
    async def main():
        async def untaken():
            await asyncio.sleep(0.05)
            raise APIError(503, "no worker took the request within 1s", code="no_worker")

        watch = asyncio.ensure_future(untaken())
        with pytest.raises(APIError, match="no worker"):
            async for _ in until_taken(_items_that_swallow_a_cancel(), watch):
                pass

    asyncio.run(asyncio.wait_for(main(), 5))


def test_until_stopped_ends_though_the_read_swallowed_the_cancel():
    async def main():
        stopping = asyncio.Event()
        asyncio.get_running_loop().call_later(0.05, stopping.set)
        got = [item async for item in until_stopped(_items_that_swallow_a_cancel(), stopping)]
        assert got == []

    asyncio.run(asyncio.wait_for(main(), 5))


@pytest.mark.parametrize("stream", ["until_stopped", "until_taken"])
def test_a_stream_left_while_it_waits_closes_its_read_once_it_has_ended(stream):
    """Starlette ends a response whose client left by cancelling its task group's scope,
    which anyio cancels again at each await: the stream's generator, cancelled while its
    step task ran the read, raised "aclose(): asynchronous generator is already running"
    and left the read running (issue 51 row 6)."""
    import anyio

    closed: list = []

    async def waiting():
        try:
            await asyncio.Event().wait()  # a queued job: no chunk comes
            yield "never"
        finally:
            closed.append("read closed")

    async def respond():
        watch = asyncio.get_running_loop().create_future()  # no verdict on workers yet
        wrap = {"until_stopped": lambda items: until_stopped(items, asyncio.Event()),
                "until_taken": lambda items: until_taken(items, watch)}[stream]  # fmt: skip
        async for _ in wrap(waiting()):
            pass

    async def main():
        async with anyio.create_task_group() as group:
            group.start_soon(respond)
            await asyncio.sleep(0.05)
            group.cancel_scope.cancel()  # the client left
        assert closed == ["read closed"]

    asyncio.run(asyncio.wait_for(main(), 5))


@pytest.mark.parametrize("stream", ["until_stopped", "until_taken"])
def test_a_left_stream_ends_its_read_though_the_read_lost_a_cancel_and_its_caller_is_recancelled(
    stream,
):
    """The CI failure of ``test_row6_leaving_waiting_openai_streams_is_quiet_too``: the
    OpenAI stream's pump (``until_outage``) is ended by ``cancel_and_wait``, which
    cancels it again every 0.1 s; the stream's close, cancelling its step (whose read
    had lost the first cancel, gh-86296) and waiting 0.1 s to cancel again, was cut
    short by the pump's second cancel, and the read ran on for good, its job's channel
    subscribed. The read must end all the same."""
    ended = asyncio.Event()

    async def loses_a_cancel():
        try:
            await _swallows_one_cancel([])
            yield "never"
        finally:
            ended.set()

    async def pump():
        watch = asyncio.get_running_loop().create_future()
        wrap = {"until_stopped": lambda items: until_stopped(items, asyncio.Event()),
                "until_taken": lambda items: until_taken(items, watch)}[stream]  # fmt: skip
        async for _ in wrap(loses_a_cancel()):
            pass

    async def main():
        task = asyncio.ensure_future(pump())
        await asyncio.sleep(0.05)
        await cancel_and_wait(task)  # the reader left
        assert task.cancelled()
        assert await _ends_within(ended.wait(), 2), "the stream's read runs on"

    asyncio.run(asyncio.wait_for(main(), 10))


def test_a_cleanup_that_fails_after_its_caller_left_logs_no_traceback(caplog):
    """``finish``'s cleanup fails once its caller was cancelled (an abort while Redis is
    away): the failure is retrieved, so asyncio logs no "exception was never retrieved"
    traceback; a caller still waiting gets it raised."""
    import gc

    from lorapool.tasks import finish

    async def fails_later():
        await asyncio.sleep(0.05)
        raise ConnectionError("Redis is away")

    async def main():
        caller = asyncio.ensure_future(finish(fails_later()))
        await asyncio.sleep(0.01)
        await cancel_and_wait(caller)  # the reader left
        await asyncio.sleep(0.1)  # the cleanup fails meanwhile
        gc.collect()
        with pytest.raises(ConnectionError):
            await finish(fails_later())

    with caplog.at_level("DEBUG"):
        asyncio.run(main())
        gc.collect()
    assert "never retrieved" not in caplog.text
    assert "Redis is away" in caplog.text  # the debug line
