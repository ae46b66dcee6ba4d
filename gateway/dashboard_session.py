"""Dashboard sessions: a browser never holds the API key.

Login (``POST /dashboard/login``, the page's form) checks the key and its role, then
issues a session: a random token (32 bytes) the gateway signs with the pool's session
key (HMAC-SHA256, the key made once in Redis and shared by every gateway), in a cookie
that is ``HttpOnly``, ``SameSite=Strict``, expires with the session (``session_ttl_s``,
an hour) and is ``Secure`` when the gateway serves TLS or stands behind a TLS proxy
(``--trust-proxy``). Redis keeps the session (``{p}:session:<sha256 of the token>``:
key id, expiry) for its lifetime; each request re-reads the key's record by its id, so
a revoked key's sessions end at once, and logout deletes the session.

The login and logout forms check ``Origin`` (or, without it, ``Referer``) against the
gateway's own origin and ``--cors-origin``: a page elsewhere cannot log a browser in
(login CSRF) or out. Wrong tries count against the client's address (10, then one
every 6 s: the same GCRA as the API's rates), past which a login gets 429.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
import time
from urllib.parse import urlsplit

import orjson

from lorapool.openai.errors import APIError
from lorapool.records.api_key import KeyRecord

COOKIE = "lorapool_session"
WRONG_TRIES_PER_MINUTE = 10


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


class Sessions:
    """The pool's dashboard sessions (the gateway's asyncio client)."""

    def __init__(self, redis, keys, ttl_s: int):
        self.redis, self.keys, self.ttl_s = redis, keys, ttl_s
        self._signing: bytes | None = None

    async def _key(self) -> bytes:
        if self._signing is None:
            fresh = secrets.token_bytes(32)
            await self.redis.set(self.keys.session_key, fresh, nx=True)
            self._signing = await self.redis.get(self.keys.session_key)
        return self._signing

    def _sign(self, key: bytes, token: str) -> str:
        return _b64(hmac.new(key, token.encode(), hashlib.sha256).digest()[:18])

    def _stored(self, token: str) -> str:
        return self.keys.session(hashlib.sha256(token.encode()).hexdigest())

    async def create(self, record: KeyRecord) -> str:
        """A session for the key ``record``; the cookie's value."""
        token = _b64(secrets.token_bytes(32))
        expires = time.time() + self.ttl_s
        data = {"key_id": record.id, "expires": expires}
        await self.redis.set(self._stored(token), orjson.dumps(data), ex=self.ttl_s)
        return f"{token}.{self._sign(await self._key(), token)}"

    async def key_id(self, cookie: str) -> str | None:
        """The key id of a live session's cookie; None for anything else."""
        token, _, signature = cookie.partition(".")
        if not token or len(cookie) > 200:
            return None
        if not hmac.compare_digest(signature, self._sign(await self._key(), token)):
            return None
        raw = await self.redis.get(self._stored(token))
        if raw is None:
            return None
        data = orjson.loads(raw)
        return data["key_id"] if data["expires"] > time.time() else None

    async def delete(self, cookie: str) -> None:
        token = cookie.partition(".")[0]
        if token:
            await self.redis.delete(self._stored(token))


def own_origin(request, trust_proxy: bool) -> str:
    """scheme://host[:port] the browser reached this gateway at (uvicorn resolves the
    scheme from X-Forwarded-Proto behind a trusted proxy)."""
    host = request.headers.get("host", "")
    if trust_proxy:
        host = request.headers.get("x-forwarded-host", host).split(",")[0].strip()
    return f"{request.url.scheme}://{host}".lower()


def check_origin(request, trust_proxy: bool, allowed: tuple[str, ...]) -> None:
    """403 unless the form was posted from this gateway's own pages (or an allowed
    origin): a state-changing form must carry Origin, or at least Referer."""
    origin = request.headers.get("origin")
    if origin is None or origin == "null":
        referer = request.headers.get("referer")
        parts = urlsplit(referer) if referer else None
        origin = f"{parts.scheme}://{parts.netloc}" if parts and parts.netloc else None
    if origin is None:
        raise APIError(403, "a form post must carry its Origin", code="cross_origin")
    origins = {own_origin(request, trust_proxy), *(o.lower() for o in allowed)}
    if origin.lower().rstrip("/") not in origins:
        raise APIError(
            403, f"a form of {origin[:100]} may not post here (CSRF)", code="cross_origin"
        )


def cookie_header(value: str, ttl_s: int, secure: bool) -> str:
    """The Set-Cookie value of a session (``ttl_s`` 0: delete it)."""
    expires = time.strftime("%a, %d %b %Y %H:%M:%S GMT", time.gmtime(time.time() + ttl_s))
    parts = [f"{COOKIE}={value}", "Path=/", f"Max-Age={ttl_s}", f"Expires={expires}"]
    parts += ["HttpOnly", "SameSite=Strict"] + (["Secure"] if secure else [])
    return "; ".join(parts)
