"""An API key's record in ``{p}:api-keys`` (id -> this record, JSON): a tenant, a role,
the adapters the tenant may use (None: all), its limits and the sha256 of the whole key,
never the key. Written by ``producer.api_keys.ApiKeys`` (the CLI's ``lorapool keys``),
read by the gateway for every request. Torch-free.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, get_args

import msgspec
from msgspec import Meta, Struct

from lorapool.records.errors import short_repr
from lorapool.records.refusal import refused

Role = Literal["submit", "audit", "admin"]
ROLES = get_args(Role)
Tenant = Annotated[str, Meta(pattern="^[A-Za-z0-9_.-]{1,64}$")]
PerMinute = Annotated[int, Meta(ge=1)]  # requests or tokens
Weight = Annotated[float, Meta(gt=0, le=1000)]  # a tenant's fair-share weight in a worker


class KeyRecord(Struct, kw_only=True, frozen=True):
    """A key's record in ``{p}:api-keys`` (JSON): what the key may do, never the key.
    Fields a later version adds are ignored by this one (no ``forbid_unknown_fields``)."""

    id: str
    tenant: Tenant
    role: Role
    sha256: str  # of the whole key
    adapters: list[str] | None = None  # None: all
    rpm: PerMinute | None = None
    tpm: PerMinute | None = None
    all_tenants: bool = False  # an audit key that reads every tenant's trail
    created: float = 0.0
    weight: Weight | None = None  # its jobs' fair-share weight in workers (None: 1)


_decode = msgspec.json.Decoder(KeyRecord).decode


def decode_key_record(raw: bytes | None) -> KeyRecord | None:
    return None if raw is None else _decode(raw)


def check_tenant(tenant: Any) -> str:
    try:
        return msgspec.convert(tenant, Tenant)
    except msgspec.ValidationError:
        raise ValueError(
            f"tenant {short_repr(tenant)} is not 1 to 64 letters, digits, '.', '_' and '-'"
        ) from None


def checked_key_record(fields: dict[str, Any]) -> KeyRecord:
    """``fields`` as a KeyRecord, each against its type; ValueError naming the first
    that does not fit and its value (worded as a refused request body is)."""
    try:
        return msgspec.convert(fields, KeyRecord)
    except msgspec.ValidationError as exc:
        raise ValueError(str(refused(str(exc), fields, KeyRecord))) from None
