"""Turns at the gateway's request work, by API key: one tenant's flood waits for its own
turns, before its key is looked up and its bodies are read, and another tenant's call
goes in at once.

The gateway has one event loop. Every request's work on it (reading and parsing its
body, checking its grammar's shape, submitting) is short, but a tenant sending many at
once from a process of its own (issue 51: grammars refused at 400, bodies over the
limit, tokenizations) kept the loop busy, and a light tenant's 15 ms call waited behind
the queue: 8.5x its alone p50 (benchmarks/RESULTS.md). A turn is taken for the
request's API key first (its lookup, its rate check and its body come after): a key has
``per_tenant`` of them (``--turns-per-tenant``, 1); its requests past that wait, in
order, costing the loop nothing, while each other key's requests take their own (a
tenant's keys are its own; 500 job-event streams opened at once held the loop 90-140 ms
when their lookups came before the turn). A turn ends when the request
has submitted its job (a completion waiting for its tokens holds none), once an upload
holds its hold (holds.py bounds a slow body; a web app's one key is not stuck behind
one user's upload), once an audit verify starts its job (its wait, up to 30 s, holds
none), or when the route's function returns (a stream's answer holds none; ``require``
in auth.py).

Turns alone left the loop busy: the flooding tenant always has a request waiting, so
one of its requests is always at work, and each step of the light tenant's call waited
behind that one's synchronous work (a 6 MB body decoded and refused: ~8 ms): 3.3x. So a
key's next turn is paced while other keys are active (checked within ``ACTIVE_S``; a
made-up key is never active): after a turn held d seconds, its next request waits d
times the number of other active keys, at most a second (d counts the turn's waits too:
a body sent slowly, a compile). One that floods alone is not paced; n that all
flood each hold turns 1/n of the time (the loop stays busy); a flood beside a light
tenant holds them half the time, and the light tenant's steps mostly find the loop
free: 1.8-2.3x (benchmarks/RESULTS.md).

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

ACTIVE_S = 2.0  # a tenant whose key was checked this recently is active (pacing)
MAX_PAUSE_S = 1.0  # a turn's length counts waits too (a slow body, a compile): capped
PRUNE_S = 0.5  # how often the active keys are pruned (not at every turn's end)


class Turns:
    """The turns of one gateway process (the app's ``state.turns``); 0: none taken.
    ``pace``: while other tenants are active, a tenant's next turn comes only after a
    pause as long as its last turn times the others' count."""

    def __init__(self, per_tenant: int, pace: bool = True):
        self.per_tenant, self.pace = per_tenant, pace
        self.busy: dict[str, int] = {}
        self.waiting: dict[str, deque[asyncio.Future]] = {}
        self.seen: dict[str, float] = {}  # tenant -> when its key was last checked
        self.resume_at: dict[str, float] = {}  # tenant -> its pause's end
        self._pruned = 0.0

    async def take(self, tenant: str | None) -> Turn:
        """A turn for ``tenant``'s request, once one of its ``per_tenant`` is free (its
        earlier requests first)."""
        if tenant is None or not self.per_tenant:
            return Turn(None, None, 0.0)
        loop = asyncio.get_running_loop()
        wait = self.resume_at.get(tenant, 0.0) - loop.time()
        if wait > 0:  # paused (``_end``): its next turn not before the pause ends
            await asyncio.sleep(wait)
        held = self.busy.get(tenant, 0)
        if held < self.per_tenant and not self.waiting.get(tenant):
            self.busy[tenant] = held + 1
            return Turn(self, tenant, loop.time())
        handed = loop.create_future()
        self.waiting.setdefault(tenant, deque()).append(handed)
        try:
            await handed  # set when an ending turn is handed over to this request
        except BaseException:
            if handed.done() and not handed.cancelled():
                self._pass_on(tenant)  # handed over as it was cancelled: pass it on
            else:
                self._forget(tenant, handed)
            raise
        return Turn(self, tenant, loop.time())

    def saw(self, tenant: str | None) -> None:
        """``tenant`` is active: its key is known (a flood of made-up keys is not)."""
        if tenant is not None and self.per_tenant:
            self.seen[tenant] = asyncio.get_running_loop().time()

    def _end(self, tenant: str, held_s: float) -> None:
        """A turn held ``held_s`` seconds ends: the tenant's next request has it, waiting
        or to come, after the pause (``_pause``) when there is one."""
        pause = self._pause(tenant, held_s)
        if pause > 0:
            loop = asyncio.get_running_loop()
            self.resume_at[tenant] = loop.time() + pause
            if self.waiting.get(tenant):
                loop.call_later(pause, self._pass_on, tenant)
                return
        self._pass_on(tenant)

    def _pause(self, tenant: str, held_s: float) -> float:
        """Its turn's time again for each other active tenant (at most ``MAX_PAUSE_S``):
        while n tenants are active, one that always has requests waiting holds a turn at
        most 1/n of the time, and the event loop has room for the others' requests when
        they come."""
        if not self.pace:
            return 0.0
        now = asyncio.get_running_loop().time()
        if now - self._pruned > PRUNE_S:
            self._pruned = now
            self.seen = {name: when for name, when in self.seen.items() if now - when <= ACTIVE_S}
            self.resume_at = {name: when for name, when in self.resume_at.items() if when > now}
        others = len(self.seen) - (tenant in self.seen)
        return min(held_s * others, MAX_PAUSE_S)

    def _pass_on(self, tenant: str) -> None:
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

    __slots__ = ("_turns", "_tenant", "_since")

    def __init__(self, turns: Turns | None, tenant: str | None, since: float):
        self._turns, self._tenant, self._since = turns, tenant, since

    def end(self) -> None:
        turns, self._turns = self._turns, None
        if turns is not None:
            turns._end(self._tenant, asyncio.get_running_loop().time() - self._since)


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
