"""The audit trail as the gateway reads it: the CLI's queries (``audit_db.queries``)
run off the event loop, scoped to the caller's tenant, paged by a keyset cursor or
streamed whole, as JSON, JSON Lines or CSV (``lorapool.audit_export``).

A tenant's auditor (an ``audit`` key of one tenant) gets its rows without what the
README keeps from tenants: the adapter's server path, the worker's name and the key ids
in the request's metadata (``tenant_internals``, ``--tenant-audit-internals``, shows
them). Admin keys, auditors of every tenant and a gateway without keys see everything.

SQLAlchemy is imported only when the gateway serves the audit routes
(``--audit-db-url``): the gateway itself needs no database driver.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import orjson

from lorapool.audit_export import encode_all
from lorapool.gateway.auth import Principal
from lorapool.openai.errors import APIError, bad_request
from lorapool.times import epoch_seconds

MAX_LIMIT = 1000
INTERNAL_COLUMNS = ("adapter_path", "worker")  # a server path, a worker's name
INTERNAL_METADATA = ("key_id",)  # which of the tenant's keys sent it


class AuditStore:
    """One engine on the audit database (a read-only role's URL, in production)."""

    def __init__(self, url: str, schema: str | None = None, tenant_internals: bool = False):
        from lorapool.audit_db import DatabaseConfig, create_audit_engine

        self.engine = create_audit_engine(DatabaseConfig(url=url, schema=schema))
        self.tenant_internals = tenant_internals
        self._jobs = None

    def shown(self, caller: Principal):
        """The function that makes a row what ``caller`` may see of it."""
        if self.tenant_internals or caller.sees_internals or caller.all_tenants:
            return _whole
        return _public

    def close(self) -> None:
        if self._jobs is not None:
            self._jobs.redis.close()
        self.engine.dispose()

    def verify_jobs(self, pool):
        """The verification jobs of this database, kept in the pool's Redis (made on
        first use, with a synchronous client of their own)."""
        from lorapool.connection import connect
        from lorapool.gateway.audit_jobs import VerifyJobs

        if self._jobs is None:
            connection = connect(pool.config.redis_url, pool.config.redis_retries)
            self._jobs = VerifyJobs(self.engine, connection, pool.producer.keys)
        return self._jobs

    async def request(self, caller: Principal, request_id: str) -> list[dict[str, Any]]:
        """The rows of one request; a tenant's auditor names it by the id its tenant
        sees, and gets only its tenant's rows."""
        from lorapool.audit_db.queries import get_request

        everyone = _everyone(caller)
        rid = request_id if everyone else caller.job_id(request_id)
        rows = await asyncio.to_thread(get_request, self.engine, rid)
        shown = self.shown(caller)
        return [shown(r) for r in rows if everyone or r["tenant"] == caller.tenant]

    async def page(
        self, caller: Principal, filters: dict[str, Any], limit: int, cursor: str | None
    ) -> tuple[list[dict[str, Any]], str | None]:
        """A page of rows in arrival order after ``cursor``, and the cursor of the next
        page (None on the last): a keyset position, so every page costs the same."""
        from lorapool.audit_db.queries import search_page

        flt = _search_filter(caller, filters)
        after = _decode_cursor(cursor) if cursor else None
        with _refusals():
            rows, next_at = await asyncio.to_thread(search_page, self.engine, flt, limit, after)
        rows = list(map(self.shown(caller), rows))
        return rows, _encode_cursor(next_at) if next_at is not None else None

    async def export(self, caller: Principal, filters: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """Every matching row in arrival order, streamed from a server-side cursor (a
        blocking iterator: Starlette runs it in its thread pool)."""
        from lorapool.audit_db.queries import check_filter, iter_search

        flt = _search_filter(caller, filters)
        with _refusals():  # before the first byte: a 400 can still go out
            await asyncio.to_thread(check_filter, self.engine, flt)
        return map(self.shown(caller), iter_search(self.engine, flt))

    async def usage(
        self,
        caller: Principal,
        by: str,
        since: float | None,
        until: float | None,
        exact: bool | None = None,
    ):
        """Usage rows (tokens, errors, latency percentiles) per adapter, adapter version
        or tenant; a tenant's auditor sees its own tenant's row only."""
        from lorapool.audit_db.queries import USAGE_GROUPS, usage

        if by not in USAGE_GROUPS:
            raise bad_request(f"group_by must be one of {', '.join(USAGE_GROUPS)}", "group_by")
        everyone = _everyone(caller)
        if not everyone and by != "tenant":
            raise APIError(403, "a tenant's auditor may group usage by tenant only", "group_by")
        rows = await asyncio.to_thread(usage, self.engine, by, since, until, exact)
        rows = [dataclasses.asdict(r) for r in rows]
        return [r for r in rows if everyone or r["key"] == caller.tenant]


def _whole(row: dict[str, Any]) -> dict[str, Any]:
    return row


def _public(row: dict[str, Any]) -> dict[str, Any]:
    """``row`` without server paths, worker names and key ids."""
    row = {k: v for k, v in row.items() if k not in INTERNAL_COLUMNS}
    metadata = row.get("request_metadata")
    if isinstance(metadata, dict):
        row["request_metadata"] = {k: v for k, v in metadata.items() if k not in INTERNAL_METADATA}
    return row


def _search_filter(caller: Principal, filters: dict[str, Any]):
    from lorapool.audit_db.queries import SearchFilter

    return SearchFilter(**{**filters, **_tenant_scope(caller, filters.get("tenant"))}, limit=None)


@contextlib.contextmanager
def _refusals():
    """A text search no index can serve, without a small window: 400 naming ``q``."""
    from lorapool.audit_db.queries import TextSearchRefused

    try:
        yield
    except TextSearchRefused as exc:
        raise bad_request(str(exc), "q") from None


def _everyone(caller: Principal) -> bool:
    """An auditor of all tenants (or a gateway without keys, which knows no tenants)."""
    return caller.all_tenants or caller.tenant is None


def _tenant_scope(caller: Principal, asked: str | None) -> dict[str, Any]:
    if _everyone(caller):
        return {}
    if asked is not None and asked != caller.tenant:
        raise APIError(403, "a tenant's auditor reads its own tenant only", "tenant")
    return {"tenant": caller.tenant}


def _encode_cursor(position: tuple[float, int]) -> str:
    return base64.urlsafe_b64encode(orjson.dumps(list(position))).decode().rstrip("=")


def _decode_cursor(cursor: str) -> tuple[float, int]:
    """(arrival_time, seq) of the row a page ended at."""
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        arrival, seq = orjson.loads(raw)
        if type(seq) is not int or not isinstance(arrival, float | int) or arrival != arrival:
            raise ValueError
        return (float(arrival), seq)
    except (ValueError, TypeError, orjson.JSONDecodeError):
        raise bad_request("cursor is not one this gateway gave", "cursor") from None


def parse_time(value: str | None, name: str) -> float | None:
    """Seconds since the epoch, or an ISO 8601 time (UTC unless it says)."""
    if value is None:
        return None
    try:
        return epoch_seconds(value)
    except ValueError:
        raise bad_request(
            f"{name} must be epoch seconds or ISO 8601, got {value!r}", name
        ) from None


def to_csv(rows: list[dict[str, Any]]) -> str:
    """Rows as CSV with a header; nested values (token ids, metadata) as JSON, text
    that a spreadsheet would run as a formula neutralised (``lorapool.audit_export``)."""
    return encode_all(rows, "csv").decode()
