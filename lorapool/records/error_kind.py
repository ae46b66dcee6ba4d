"""Why a request failed, as a kind its final chunk carries beside the error text.

The worker (or the reader that ends a request no worker will finish) names the kind
where the error is made; readers route by it (``lorapool.openai.errors.failed_request``:
500 for an engine fault, else 400), never by the message's wording, which stays free to
say whatever helps a person. Torch-free, standard library only (``wire`` needs it).
"""

from __future__ import annotations

from enum import Enum


class ErrorKind(str, Enum):
    """What failed a request; the value is what a chunk's ``ek`` holds."""

    REQUEST = "request"  # refused as asked: at intake, by add_request or by the engine
    ENGINE = "engine"  # an engine step failed under it (the worker's fault, not the request's)
    GIVEN_UP = "given_up"  # delivered past max_deliveries: its workers kept stopping
    REMOVED = "removed"  # an operator removed its queue entry (ran partially or never)
    STORAGE = "storage"  # its chunk log key holds another type than a list

    def __str__(self) -> str:
        return self.value


# the message a worker of the version before kinds gave an engine fault (its one rule)
_LEGACY_ENGINE = "engine step failed"


def read_kind(value: object, error: str) -> ErrorKind:
    """The kind a chunk's ``ek`` names; for a chunk without one (written before kinds)
    or with one this build does not know, the rule readers applied to its text then:
    an engine fault if it starts "engine step failed", else the request's."""
    try:
        return ErrorKind(value)
    except ValueError:
        return ErrorKind.ENGINE if error.startswith(_LEGACY_ENGINE) else ErrorKind.REQUEST
