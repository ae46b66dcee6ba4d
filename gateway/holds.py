"""Long-lived requests, bounded per tenant and in total.

A job-events stream, an OpenAI ``stream: true`` call, a file upload and a download (a
file's content, an audit export) each hold a connection, a Pub/Sub subscription, a
spooled body or a thread and a database cursor, and memory, for as long as the client
likes. The per-address cap (``server.py``) does not bound one tenant: its
clients come from many addresses. So each such request takes a hold before any work
(before its job is submitted, before an upload's body is read), and gives it back when
its answer ends, however it ends:

- past ``per_tenant`` held by its tenant: 429 ``too_many_streams`` naming the cap;
  the tenant's other calls, and every other tenant, go on;
- past ``total`` held on this gateway: 503 ``too_many_streams`` with Retry-After
  (another replica may have room).

A gateway without keys knows no tenants: only the total applies. Memory per held
stream is measured in benchmarks/RESULTS.md (issue 51, row 5), so ``total`` bounds
what held streams may take.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator

from fastapi.responses import StreamingResponse

from lorapool.openai.errors import APIError

KINDS = "job-events streams, streamed completions, uploads and downloads"


class Holds:
    """The counts of one gateway process (the app's ``state.holds``)."""

    def __init__(self, per_tenant: int, total: int):
        self.per_tenant, self.total = per_tenant, total
        self.by_tenant: dict[str, int] = {}
        self.count = 0

    def take(self, tenant: str | None) -> Hold:
        """A hold for a request of ``tenant``; APIError (429, 503) past a cap."""
        if self.total and self.count >= self.total:
            raise APIError(
                503,
                f"this gateway holds {self.total} long-lived requests ({KINDS}), its cap "
                "(--max-streams); retry shortly",
                code="too_many_streams",
                headers={"Retry-After": "1"},
            )
        held = self.by_tenant.get(tenant, 0) if tenant is not None else 0
        if tenant is not None and self.per_tenant and held >= self.per_tenant:
            raise APIError(
                429,
                f"tenant {tenant} holds {held} long-lived requests ({KINDS}), its cap "
                "(--max-streams-per-tenant); end one first",
                code="too_many_streams",
                headers={"Retry-After": "1"},
            )
        self.count += 1
        if tenant is not None:
            self.by_tenant[tenant] = held + 1
        return Hold(self, tenant)

    def give_back(self, tenant: str | None) -> None:
        self.count -= 1
        if tenant is not None:
            left = self.by_tenant[tenant] - 1
            if left:
                self.by_tenant[tenant] = left
            else:
                del self.by_tenant[tenant]

    @contextlib.contextmanager
    def holding(self, tenant: str | None) -> Iterator[Hold]:
        """A hold for the duration of the block (an upload's)."""
        hold = self.take(tenant)
        try:
            yield hold
        finally:
            hold.release()


class Hold:
    """One held request; ``release`` gives it back once, however often it is called."""

    def __init__(self, holds: Holds, tenant: str | None):
        self._holds, self._tenant = holds, tenant

    def release(self) -> None:
        holds, self._holds = self._holds, None
        if holds is not None:
            holds.give_back(self._tenant)

    def stream(self, content, **kwargs) -> StreamingResponse:
        """A streaming response of ``content`` that releases this hold when it ends."""
        return HeldStream(content, self, **kwargs)


class HeldStream(StreamingResponse):
    """A StreamingResponse holding a ``Hold`` until its answer has ended (or, as a
    backstop, until it is collected without having been sent)."""

    def __init__(self, content, hold: Hold, **kwargs):
        super().__init__(content, **kwargs)
        self._hold = hold
        weakref.finalize(self, hold.release)

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._hold.release()


def holds_of(request) -> Holds:
    return request.app.state.holds
