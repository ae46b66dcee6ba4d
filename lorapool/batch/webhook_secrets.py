"""Webhook signing as the Standard Webhooks spec says, with one secret per tenant.

Each delivery carries ``webhook-id`` (the same on every retry: receivers deduplicate on
it), ``webhook-timestamp`` (seconds, this attempt's) and ``webhook-signature``:
``v1,<base64 HMAC-SHA256 of "<id>.<timestamp>.<body>">``, one per valid secret,
space-separated. A secret reads ``whsec_<base64 of 24 random bytes>``, the form the
``standardwebhooks`` package and the ``openai`` client's ``webhooks.unwrap`` take.

Secrets live in ``{p}:webhook-secrets`` (tenant -> its secrets, newest first). A
rotation adds a new one and keeps the previous one valid for an overlap (deliveries
carry both signatures meanwhile), so a receiver can switch at its own pace. A tenant
never sees another's secret, so none can sign what another's receiver accepts; a
receiver rejects a delivery whose timestamp is outside its tolerance (5 minutes in
both libraries), so a captured delivery cannot be replayed later.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
import time
from typing import Any

import orjson

from lorapool.lifecycle.keys import Keys

PREFIX = "whsec_"
DEFAULT_OVERLAP_S = 24 * 3600


def new_secret() -> str:
    return PREFIX + base64.b64encode(secrets.token_bytes(24)).decode()


def sign(secret: str, msg_id: str, timestamp: int, body: bytes) -> str:
    """One ``v1,<signature>`` of ``body`` under ``secret``."""
    key = base64.b64decode(secret.removeprefix(PREFIX))
    signed = f"{msg_id}.{timestamp}.".encode() + body
    return "v1," + base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()).decode()


def signed_headers(
    valid: list[str], msg_id: str, body: bytes, now: float | None = None
) -> list[tuple[str, str]]:
    """The headers of one delivery attempt of ``body``, signed with every valid secret."""
    timestamp = int(time.time() if now is None else now)
    signatures = " ".join(sign(s, msg_id, timestamp, body) for s in valid)
    return [
        ("webhook-id", msg_id),
        ("webhook-timestamp", str(timestamp)),
        ("webhook-signature", signatures),
        ("Content-Type", "application/json"),
        ("User-Agent", "lorapool-webhooks/1"),
    ]


class WebhookSecrets:
    """The tenants' webhook secrets (synchronous: the CLI's and the RQ workers' side).
    Tenant ``""`` signs the jobs that carry none (``--no-auth``, Python producers)."""

    def __init__(self, connection, keys: Keys):
        self.redis, self.keys = connection, keys

    def _read(self, tenant: str) -> list[dict[str, Any]]:
        raw = self.redis.hget(self.keys.webhook_secrets, tenant)
        return [] if raw is None else orjson.loads(raw)

    def _write(self, tenant: str, entries: list[dict[str, Any]]) -> None:
        self.redis.hset(self.keys.webhook_secrets, tenant, orjson.dumps(entries))

    def valid(self, tenant: str, now: float | None = None) -> list[str]:
        """The secrets deliveries of ``tenant`` are signed with now (newest first)."""
        now = time.time() if now is None else now
        return [
            e["secret"]
            for e in self._read(tenant)
            if e.get("expires") is None or e["expires"] > now
        ]

    def current(self, tenant: str) -> str:
        """The tenant's newest secret, made now if it has none."""
        entries = self._read(tenant)
        if not entries:
            entries = [{"secret": new_secret(), "created": time.time(), "expires": None}]
            self._write(tenant, entries)
        return entries[0]["secret"]

    def rotate(self, tenant: str, overlap_s: float = DEFAULT_OVERLAP_S) -> str:
        """A new secret; the previous one stays valid ``overlap_s`` more seconds."""
        now = time.time()
        old = [e for e in self._read(tenant) if e.get("expires") is None or e["expires"] > now]
        for entry in old[:1]:
            entry["expires"] = now + overlap_s if entry.get("expires") is None else entry["expires"]
        entries = [{"secret": new_secret(), "created": now, "expires": None}, *old[:1]]
        self._write(tenant, entries)
        return entries[0]["secret"]

    def drop_old(self, tenant: str) -> int:
        """End a rotation now: only the newest secret stays; how many were dropped."""
        entries = self._read(tenant)
        if len(entries) > 1:
            self._write(tenant, entries[:1])
        return max(0, len(entries) - 1)

    def tenants(self) -> list[str]:
        return sorted(k.decode() for k in self.redis.hkeys(self.keys.webhook_secrets))
