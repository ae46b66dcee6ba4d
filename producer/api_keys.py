"""API keys of the gateway: each maps to a tenant and a role, stored hashed in Redis.

A key reads ``lp_<id>_<secret>``; ``{p}:api-keys`` maps the id to a record with the
tenant, the role, the adapters the tenant may use (None: all) and the sha256 of the
whole key, compared in constant time. The key itself is shown once, at ``add``.
Torch-free.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import time

import msgspec

from lorapool.lifecycle.keys import Keys
from lorapool.producer.registry import check_name
from lorapool.records.api_key import (
    KeyRecord,
    check_tenant,
    checked_key_record,
    decode_key_record,
)

_KEY_PATTERN = re.compile(r"lp_([0-9a-f]{16})_[A-Za-z0-9_-]{43}")


def key_sha256(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def matching_record(key: str, raw: bytes | None) -> KeyRecord | None:
    """The record ``raw`` if ``key`` is the key it was made for, else None."""
    if raw is None:
        return None
    record = decode_key_record(raw)
    return record if hmac.compare_digest(record.sha256, key_sha256(key)) else None


def key_id_of(key: str) -> str | None:
    """The id part of a well-formed key; None for anything else."""
    match = _KEY_PATTERN.fullmatch(key)
    return match.group(1) if match else None


class ApiKeys:
    """Add, list and revoke keys (synchronous: the CLI's side)."""

    def __init__(self, connection, keys: Keys):
        self.redis = connection
        self.keys = keys

    def add(
        self,
        tenant: str,
        role: str,
        adapters: list[str] | None = None,
        rpm: int | None = None,
        tpm: int | None = None,
        all_tenants: bool = False,
        weight: float | None = None,
    ) -> tuple[KeyRecord, str]:
        """Add a key; its record and the key (shown once; only its sha256 is stored).

        ``all_tenants``: an ``audit`` key that reads every tenant's audit trail.

        ``rpm`` / ``tpm``: the tenant's requests and tokens per minute through this key
        (None: unlimited); tokens are what a request may generate (max_tokens x n).
        ``weight``: the share of a worker its jobs get beside other tenants' (None: 1;
        ``lorapool.engine.fair_share``).
        """
        check_tenant(tenant)  # its own words: the rule, not a regex
        if adapters is not None:
            adapters = sorted({check_name(a) for a in adapters})
        key_id = secrets.token_hex(8)
        key = f"lp_{key_id}_{secrets.token_urlsafe(32)}"
        record = checked_key_record(
            {
                "id": key_id,
                "tenant": tenant,
                "role": role,
                "adapters": adapters,
                "rpm": rpm,
                "tpm": tpm,
                "all_tenants": all_tenants,
                "sha256": key_sha256(key),
                "created": time.time(),
                "weight": weight,
            }
        )
        if all_tenants and role != "audit":
            raise ValueError(f"only an audit key may read all tenants, not a {role} key")
        self.redis.hset(self.keys.api_keys, key_id, msgspec.json.encode(record))
        return record, key

    def list(self) -> list[KeyRecord]:
        records = [decode_key_record(v) for v in self.redis.hvals(self.keys.api_keys)]
        return sorted(records, key=lambda r: (r.tenant, r.created))

    def revoke(self, key_id: str) -> bool:
        return bool(self.redis.hdel(self.keys.api_keys, key_id))


# what a lookup compares against when the key id is unknown or the key malformed
_ABSENT = msgspec.json.encode(KeyRecord(id="0" * 16, tenant="-", role="submit", sha256="0" * 64))


async def authenticate(connection, keys: Keys, key: str) -> KeyRecord | None:
    """The record of ``key`` (an asyncio Redis client's read), None when unknown or
    revoked. The same work whether or not the key id exists, or the key is well formed
    (one read, one parse, one sha256 and a constant-time comparison), so its time does
    not tell a key id that exists from one that does not."""
    key_id = key_id_of(key)
    raw = await connection.hget(keys.api_keys, key_id or "-")
    record = matching_record(key, raw if raw is not None else _ABSENT)
    return record if key_id is not None and raw is not None else None
