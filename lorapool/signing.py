"""The audit key: where it comes from, and HMAC-SHA256 with it (stdlib only).

Workers sign every audit record with the key and the audit writer checks the
signature before a row is written; the writer also chains rows with it (see
``lorapool.audit_db.chain``), so without the key nobody can forge a record or
re-chain the table. The key comes from ``$LORAPOOL_AUDIT_KEY`` (the key itself,
at least 32 characters) or ``$LORAPOOL_AUDIT_KEY_FILE`` (a file holding it;
surrounding whitespace is ignored). Without a key, workers and the writer
refuse to start unless told ``--insecure-no-key`` or
``LORAPOOL_AUDIT_INSECURE=1``.
"""

from __future__ import annotations

import hmac
import os
import secrets
from pathlib import Path

KEY_ENV = "LORAPOOL_AUDIT_KEY"
KEY_FILE_ENV = "LORAPOOL_AUDIT_KEY_FILE"
INSECURE_ENV = "LORAPOOL_AUDIT_INSECURE"
MIN_KEY_LENGTH = 32
NO_KEY_HELP = (
    f"no audit key: set {KEY_ENV} (at least {MIN_KEY_LENGTH} characters) or {KEY_FILE_ENV} "
    f"(`lorapool audit keygen` makes one), or run with --insecure-no-key / {INSECURE_ENV}=1 "
    "to write audit records nobody can authenticate"
)


class AuditKeyError(ValueError):
    """The audit key is missing, unreadable or too short; the message says which."""


def _checked(key: str, where: str) -> bytes:
    key = key.strip()
    if len(key) < MIN_KEY_LENGTH:
        raise AuditKeyError(
            f"{where}: the audit key has {len(key)} characters, at least "
            f"{MIN_KEY_LENGTH} are needed"
        )
    return key.encode()


def key_from_env(environ: dict[str, str] | None = None) -> bytes | None:
    """The audit key from the environment, or None when neither variable is set."""
    env = os.environ if environ is None else environ
    if env.get(KEY_ENV):
        return _checked(env[KEY_ENV], KEY_ENV)
    path = env.get(KEY_FILE_ENV)
    if not path:
        return None
    try:
        return _checked(Path(path).read_text(), f"{KEY_FILE_ENV}={path}")
    except OSError as exc:
        raise AuditKeyError(f"{KEY_FILE_ENV}={path}: cannot read the audit key: {exc}") from None


def insecure_from_env(environ: dict[str, str] | None = None) -> bool:
    """True when ``$LORAPOOL_AUDIT_INSECURE`` asks to run without a key."""
    env = os.environ if environ is None else environ
    return env.get(INSECURE_ENV, "").strip().lower() in ("1", "true", "yes")


def require_key(key: bytes | None, insecure: bool) -> None:
    """Raise AuditKeyError (saying how to set one) unless there is a key or insecure is asked."""
    if key is None and not insecure:
        raise AuditKeyError(NO_KEY_HELP)


def new_key() -> str:
    """A fresh random key (64 hex characters)."""
    return secrets.token_hex(32)


def write_key_file(path: Path) -> bytes:
    """Make ``path`` hold a key (created once, mode 0600); returns the key."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(new_key() + "\n")
    return _checked(path.read_text(), str(path))


def mac(key: bytes, domain: str, *parts: bytes) -> str:
    """HMAC-SHA256 (hex) of ``parts`` under ``key``, separated by a domain label.

    Each part is length-prefixed, so (b"ab", b"c") and (b"a", b"bc") differ; the
    domain keeps a signature made for one purpose from being valid for another.
    """
    # one message and one C call (hmac.digest): the same bytes as updating part by
    # part, at a third of the cost (the writer signs and checks one per row)
    message = [domain.encode(), b"\0"]
    for part in parts:
        message.append(len(part).to_bytes(8, "big"))
        message.append(part)
    return hmac.digest(key, b"".join(message), "sha256").hex()


def same(a: str, b: str) -> bool:
    """Constant-time comparison of two hex digests."""
    return hmac.compare_digest(a.encode(), b.encode())
