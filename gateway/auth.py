"""Who is calling: an API key (``Authorization: Bearer lp_...``) names a tenant and a
role; routes declare the role they need. No key or an unknown one → 401, a key
without the role → 403.

Every authenticated call counts against its key's requests per minute, before any work
(429 with Retry-After past it): ``require`` takes one request from a key with an rpm at
the door. Routes that submit work (completions, chat, responses, jobs) take their own
count instead, once the body says how many prompts and tokens (``submits=True``,
``OpenAIServing.check_rate``); at the door they only look whether the key's minute has
room for one request, any submit's least, and answer 429 before the body is read when
it has not (a refused key's 97 KB schema cost the gateway 11 ms of parsing a call, as
much as a served one's). Health, readiness and ``/metrics`` (Prometheus) count nothing.

Tenants never see each other's jobs: a job's request id is the tenant's name, ``~``
and the id the client sees, so another tenant's id names a job that does not exist
(404, revealing nothing). The tenant and key id go into the job's metadata, and so
into its audit row.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Depends, Request

from lorapool.gateway.turns import take_turn
from lorapool.openai.errors import APIError
from lorapool.records.api_key import KeyRecord


@dataclass(frozen=True)
class Principal:
    """The caller: tenant, role, key id, the adapters it may use (None: all) and its
    requests and tokens per minute (None: unlimited)."""

    tenant: str | None = None
    role: str | None = None
    key_id: str | None = None
    adapters: frozenset[str] | None = None
    rpm: int | None = None
    tpm: int | None = None
    all_tenants: bool = False  # an auditor of every tenant
    weight: float | None = None  # its jobs' fair-share weight in workers (None: 1)

    def job_id(self, external: str) -> str:
        """The request id of the client's job id ``external``."""
        return external if self.tenant is None else f"{self.tenant}~{external}"

    def external_id(self, request_id: str) -> str:
        return request_id if self.tenant is None else request_id.split("~", 1)[1]

    @property
    def sees_internals(self) -> bool:
        """Server paths and worker names are shown to admin keys and to an open
        (no-auth) deployment only, never to a tenant's submit or audit key."""
        return self.tenant is None or self.role == "admin"

    def may_use(self, adapter: str) -> bool:
        return self.adapters is None or adapter in self.adapters

    def metadata(self) -> dict[str, Any]:
        if self.tenant is None:
            return {}
        own = {"tenant": self.tenant, "key_id": self.key_id}
        return own if self.weight is None else {**own, "weight": self.weight}

    def job_metadata(self, given: dict[str, Any]) -> dict[str, Any]:
        """A job's metadata: what the client gave, then the caller's own, which a
        tenant cannot set (a ``weight`` it gives is dropped: workers read the tenant's
        fair-share weight there)."""
        if self.tenant is not None:
            given = {k: v for k, v in given.items() if k != "weight"}
        return {**given, **self.metadata()}


OPEN = Principal()  # auth off: one trusted network, no tenants


def needs(*roles: str, counted: bool = True, submits: bool = False) -> Any:
    """A route's caller parameter: ``Annotated[Principal, needs("submit")]``."""
    return Depends(require(*roles, counted=counted, submits=submits), scope="function")


def require(*roles: str, counted: bool = True, submits: bool = False) -> Callable:
    """A dependency with ``yield`` (``needs``: run at function scope): a turn at the
    gateway's work (``turns.py``) for the request's API key, then ``authenticate``'s
    caller; the turn is held until the route's function returns (or ``end_turn``). The
    turn comes first: a flood's key lookups and rate checks wait in its own queue too
    (500 job-event streams opened at once held the loop 90-140 ms before their turns)."""
    check = authenticate(*roles, counted=counted, submits=submits)

    async def caller(request: Request) -> AsyncIterator[Principal]:
        key = _bearer(request) if _auth_on(request) else None
        turn = await take_turn(request, key)
        try:
            found = await check(request)
            request.app.state.turns.saw(key)
            yield found
        finally:
            turn.end()

    return caller


def authenticate(*roles: str, counted: bool = True, submits: bool = False) -> Callable:
    """The caller, if its key has one of ``roles`` (any role if none), its call taken
    from the key's requests per minute (``counted``: False for a route that counts
    nothing). ``submits``: the route takes its own count of what it submits once the
    body is read; here only a 429 when the minute has no room for one."""

    async def caller(request: Request) -> Principal:
        pool = request.app.state.pool
        if not pool.config.auth:
            return OPEN
        record = await _record(request)
        request.state.tenant = record.tenant  # for the HTTP metrics' 429s by tenant
        found = principal(record, roles)
        if submits:
            await request.app.state.serving.check_room(found)
        elif counted:
            await count(request, found)
        return found

    return caller


async def count(request: Request, caller: Principal) -> None:
    """Take one call from ``caller``'s requests per minute (nothing without an rpm):
    429 with Retry-After and the ``x-ratelimit-*`` headers past it."""
    if caller.rpm is not None:
        request.state.rate_headers = await request.app.state.serving.check_rate(caller, 1, None)


def principal(record: KeyRecord, roles: tuple[str, ...] = ()) -> Principal:
    """The caller a key's record names; 403 unless its role is one of ``roles``."""
    if roles and record.role not in roles:
        raise APIError(
            403,
            f"this key's role ({record.role}) may not do this; it needs " + " or ".join(roles),
            code="forbidden",
        )
    adapters = record.adapters
    return Principal(
        record.tenant,
        record.role,
        record.id,
        None if adapters is None else frozenset(adapters),
        record.rpm,
        record.tpm,
        record.all_tenants,
        record.weight,
    )


def _auth_on(request: Request) -> bool:
    return request.app.state.pool.config.auth


def _bearer(request: Request) -> str | None:
    """The request's API key (None when it names none)."""
    scheme, _, key = request.headers.get("authorization", "").partition(" ")
    key = key.strip()
    return key if scheme.lower() == "bearer" and key else None


async def _record(request: Request) -> KeyRecord:
    key = _bearer(request)
    if key is None:
        raise unauthorized("no API key: send Authorization: Bearer <key>")
    record = await request.app.state.pool.view.api_key(key)
    if record is None:
        raise unauthorized("invalid API key")
    return record


def unauthorized(message: str) -> APIError:
    return APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
