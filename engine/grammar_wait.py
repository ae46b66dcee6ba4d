"""Requests that wait for their grammar: compiled off the step's thread, then scheduled.

A worker's engine (one whose ``GuideFactory`` has a sandbox) never compiles a new
grammar on the step's thread: a request whose constraint is not compiled yet waits
here, outside the scheduler (no sequence slot, no KV block), while the factory's pool
compiles it; each step, before scheduling, those whose compile ended join the
scheduler or fail alone with the compiler's words (``request <id>: structured_outputs
.<kind>: ...``, what the gateway's 400 says of the same constraint). Others' steps go
on meanwhile: before this, a 500-rule GBNF (inside the limits) held every other
request's next token for the whole compile (~0.5 s on a 2-core CPU VM; RESULTS.md,
"grammar compile off the step").

vLLM's v1 engine does the same with its ``WAITING_FOR_FSM`` status and a thread pool
of grammar compiles.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait

from lorapool.engine.guide import Guide, GuideFactory, request_guide, resume

# with nothing else to run, a step waits at most this long for a compile to end
# (the worker's loop reads new jobs and keeps its upkeep between steps)
POLL_S = 0.05


class GrammarWait:
    """The requests of one engine whose grammar compiles, by request id."""

    def __init__(self, factory: GuideFactory):
        self.factory = factory
        self.waiting: dict[str, tuple[Future, object]] = {}

    def __len__(self) -> int:
        return len(self.waiting)

    def start(self, seq) -> bool:
        """Give ``seq`` (a new request's first sequence) its grammar state now when it
        has none to compile, or put it here while its grammar compiles (True: it waits;
        the caller schedules it otherwise). ValueError naming the problem when compiled
        here (no sandbox) and refused."""
        request = seq.request
        constraint = request.params.structured_outputs
        if constraint is None:
            return False
        future = self.factory.submit(constraint)
        if future is None:
            seq.guide = request_guide(self.factory, request)
            return False
        self.waiting[request.request_id] = (future, seq)
        return True

    def drop(self, request_id: str) -> None:
        """Forget a request that ended while it waited (its compile still fills the cache)."""
        self.waiting.pop(request_id, None)

    def admit(self, scheduler, fail: Callable[[str, str], None]) -> None:
        """Sequences whose grammar compiled join ``scheduler``; a request whose compile
        failed ends alone (``fail(request_id, error)``). When the scheduler has nothing
        to run, waits up to ``POLL_S`` for a compile to end first."""
        if not self.waiting:
            return
        if not scheduler.has_unfinished():
            wait([future for future, _ in self.waiting.values()], POLL_S, FIRST_COMPLETED)
        for request_id, (future, seq) in list(self.waiting.items()):
            if future.done():
                del self.waiting[request_id]
                error = _start(future, seq)
                if error is None:
                    scheduler.add(seq)
                else:
                    fail(request_id, error)


def _start(future: Future, seq) -> str | None:
    """Give ``seq`` its grammar state from its finished compile; the error, if any."""
    request = seq.request
    try:
        prototype = future.result()
    except Exception as exc:  # noqa: BLE001 - whatever ended the compile fails its request
        return f"request {request.request_id}: {str(exc) or type(exc).__name__}"
    try:
        seq.guide = resume(Guide(prototype.deep_copy(), prototype), request)
    except ValueError as exc:
        return str(exc)
    return None
