"""Who is calling: an API key (``Authorization: Bearer lp_...``) names a tenant and a
role; routes declare the role they need. No key or an unknown one → 401, a key
without the role → 403.

Tenants never see each other's jobs: a job's request id is the tenant's name, ``~``
and the id the client sees, so another tenant's id names a job that does not exist
(404, revealing nothing). The tenant and key id go into the job's metadata, and so
into its audit row.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request

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


def require(*roles: str) -> Callable:
    """A dependency: the caller, if its key has one of ``roles`` (any role if none)."""

    async def caller(request: Request) -> Principal:
        pool = request.app.state.pool
        if not pool.config.auth:
            return OPEN
        record = await _record(request)
        request.state.tenant = record.tenant  # for the HTTP metrics' 429s by tenant
        return principal(record, roles)

    return caller


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


async def _record(request: Request) -> KeyRecord:
    header = request.headers.get("authorization", "")
    scheme, _, key = header.partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise unauthorized("no API key: send Authorization: Bearer <key>")
    record = await request.app.state.pool.view.api_key(key.strip())
    if record is None:
        raise unauthorized("invalid API key")
    return record


def unauthorized(message: str) -> APIError:
    return APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
