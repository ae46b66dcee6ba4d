"""Text stored exactly: every code point, NUL included, on PostgreSQL and SQLite.

PostgreSQL's ``text`` refuses U+0000 and SQLite's string functions stop at it
(``length('a' || char(0) || 'b')`` is 1). So text columns hold an escaped form
that contains no NUL, decoded on the way out; the hash chain is computed over
the decoded text, so it does not depend on this. Two noncharacters (which
Unicode reserves for a program's internal use) do the escaping::

    NUL -> ESC MARK      ESC -> ESC ESC      MARK -> MARK MARK

Every other code point is stored as itself, so a search for a needle without
NUL, ESC or MARK finds exactly what it would in the plain text (see
:func:`needs_recheck` for the others).
"""

from __future__ import annotations

import re

from sqlalchemy import String, Text
from sqlalchemy.types import TypeDecorator

ESC = "\ufdd0"
MARK = "\ufdd1"
_ENCODE = str.maketrans({"\0": ESC + MARK, ESC: ESC + ESC, MARK: MARK + MARK})
_PAIR = re.compile(f"{ESC}[{ESC}{MARK}]|{MARK}{MARK}")
_DECODE = {ESC + MARK: "\0", ESC + ESC: ESC, MARK + MARK: MARK}


class EncodingError(ValueError):
    """Stored text that is not a valid escaped form (written by something else)."""


def needs_recheck(value: str) -> bool:
    """True when a substring search for ``value`` in escaped text may over-match."""
    return "\0" in value or ESC in value or MARK in value  # str.__contains__: C speed


def encode(value: str) -> str:
    """The stored form of ``value`` (no NUL in it)."""
    if not needs_recheck(value):
        return value
    return value.translate(_ENCODE)


def decode(stored: str) -> str:
    """The text whose stored form is ``stored``; inverse of :func:`encode`."""
    if ESC not in stored and MARK not in stored:
        return stored
    decoded = _PAIR.sub(lambda m: _DECODE[m.group()], stored)
    if encode(decoded) != stored:
        raise EncodingError(f"stored text {stored[:40]!r} is not a valid escaped form")
    return decoded


class ExactText(TypeDecorator):
    """A ``text`` column (``varchar`` with ``length``) that keeps every code point."""

    impl = Text
    cache_ok = True

    def __init__(self, length: int | None = None):
        super().__init__()
        self.length = length

    def load_dialect_impl(self, dialect):
        impl = String(self.length) if self.length else Text()
        return dialect.type_descriptor(impl)

    def process_bind_param(self, value, dialect):
        return value if value is None else encode(value)

    def process_result_value(self, value, dialect):
        return value if value is None else decode(value)

    @property
    def python_type(self):
        return str
