"""Turns at the gateway's request work, by tenant: one tenant's flood waits for its own
turns, before its bodies are read, and another tenant's call goes in at once.

The gateway has one event loop. Every request's work on it (reading and parsing its
body, checking its grammar's shape, submitting) is short, but a tenant sending many at
once from a process of its own (issue 51: grammars refused at 400, bodies over the
limit, tokenizations) kept the loop busy, and a light tenant's 15 ms call waited behind
the queue: 8.5x its alone p50 (benchmarks/RESULTS.md). A turn is taken after the key is
known and its rate checked, before the body is read: a tenant has ``per_tenant`` of them
(``--turns-per-tenant``); its requests past that wait, in order, costing the loop
nothing, while each other tenant's requests take their own. A turn ends when the request
has submitted its job (a completion waiting for its tokens holds none), or when the
route's function returns (a stream's answer holds none; ``require`` in auth.py).

A request waiting for its turn keeps its body deadline (``server.py``): a body that fits
uvicorn's 64 KiB buffer is in before the wait matters, a larger one has had at least
64 KiB counted (over two minutes at 500 bytes a second), and a tenant's dripped bodies
are not held longer by queueing them behind each other. A gateway without keys knows
no tenants and takes no turns.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque

from fastapi import Request


class Turns:
    """The turns of one gateway process (the app's ``state.turns``); 0: none taken."""

    def __init__(self, per_tenant: int):
        self.per_tenant = per_tenant
        self.busy: dict[str, int] = {}
        self.waiting: dict[str, deque[asyncio.Future]] = {}

    async def take(self, tenant: str | None) -> Turn:
        """A turn for ``tenant``'s request, once one of its ``per_tenant`` is free (its
        earlier requests first)."""
        if tenant is None or not self.per_tenant:
            return Turn(None, None)
        held = self.busy.get(tenant, 0)
        if held < self.per_tenant and not self.waiting.get(tenant):
            self.busy[tenant] = held + 1
            return Turn(self, tenant)
        handed = asyncio.get_running_loop().create_future()
        self.waiting.setdefault(tenant, deque()).append(handed)
        try:
            await handed  # set when an ending turn is handed over to this request
        except BaseException:
            if handed.done() and not handed.cancelled():
                self._end(tenant)  # handed over as it was cancelled: pass it on
            else:
                self._forget(tenant, handed)
            raise
        return Turn(self, tenant)

    def _end(self, tenant: str) -> None:
        queue = self.waiting.get(tenant)
        while queue:
            handed = queue.popleft()
            if not handed.done():
                handed.set_result(None)  # the turn passes on: busy stays as it is
                if not queue:
                    del self.waiting[tenant]
                return
        self.waiting.pop(tenant, None)
        left = self.busy[tenant] - 1
        if left:
            self.busy[tenant] = left
        else:
            del self.busy[tenant]

    def _forget(self, tenant: str, handed: asyncio.Future) -> None:
        queue = self.waiting.get(tenant)
        if queue is not None:
            with contextlib.suppress(ValueError):
                queue.remove(handed)
            if not queue:
                del self.waiting[tenant]


class Turn:
    """One request's turn; ``end`` gives it back once, however often it is called."""

    __slots__ = ("_turns", "_tenant")

    def __init__(self, turns: Turns | None, tenant: str | None):
        self._turns, self._tenant = turns, tenant

    def end(self) -> None:
        turns, self._turns = self._turns, None
        if turns is not None:
            turns._end(self._tenant)


async def take_turn(request: Request, tenant: str | None) -> Turn:
    """``request``'s turn (kept on its state for ``end_turn``)."""
    turns: Turns = request.app.state.turns
    turn = await turns.take(tenant)
    request.state.turn = turn
    return turn


def end_turn(request: Request) -> None:
    """``request`` is done with the loop's work before its wait (its job is submitted)."""
    turn = getattr(request.state, "turn", None)
    if turn is not None:
        turn.end()
