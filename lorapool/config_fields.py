"""A config dataclass checked against its own annotations.

A field's type and bounds are written once, on the field, as the constraint types of
``lorapool.records.bounds`` are (``max_n: NonNegative = 8``); :func:`check_fields`, called from
``__post_init__``, checks every value against them with msgspec (strict: a bool is no
integer, a string no number) and raises ValueError naming the field and its value,
its bound worded by ``bounds.explain`` ("max_n must be an integer >= 0, got -1"; an
optional one: "... >= 0 (or None), got -1"). The error is an :class:`OptionError`
carrying the field's name, so a command line can name its own option.
"""

from __future__ import annotations

import dataclasses
import functools
import types
from typing import Annotated, Any, Union, get_args, get_origin, get_type_hints

import msgspec
from msgspec import Meta

from lorapool.records.bounds import FINITE, explain, meta_of

# A wait or a period in seconds: finite, above 0. (Its description keeps it an object of
# its own: typing caches Annotated by equal arguments, and Meta(gt=0) equals Meta(gt=0.0)
# of another alias, whose bound would then be worded "> 0.0".)
Wait = Annotated[float, Meta(gt=0, le=FINITE, description="seconds")]
AtLeast1 = Annotated[int, Meta(ge=1)]  # a count a deployment sets (no wire bound)


@functools.cache
def _annotations(cls: type) -> tuple[tuple[str, Any], ...]:
    hints = get_type_hints(cls, include_extras=True)
    return tuple((f.name, hints[f.name]) for f in dataclasses.fields(cls) if f.init)


class OptionError(ValueError):
    """A config's field refused; ``field`` names it (the message says why)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def check_fields(config: object) -> None:
    """Each field of the dataclass ``config`` (those its ``__init__`` takes) against its
    annotation; OptionError (a ValueError) for the first that does not fit."""
    for name, annotation in _annotations(type(config)):
        value = getattr(config, name)
        try:
            msgspec.convert(value, annotation)
        except msgspec.ValidationError as exc:
            bounded, optional = _optional(annotation)
            if meta_of(bounded) is None:  # a plain type: msgspec's words
                raise OptionError(name, f"{name}={value!r}: {exc}") from None
            wanted = explain(bounded) + (" (or None)" if optional else "")
            raise OptionError(name, f"{name} must be {wanted}, got {value!r}") from None


def _optional(annotation: Any) -> tuple[Any, bool]:
    """``X | None`` as (X, True); anything else as (itself, False)."""
    if get_origin(annotation) in (Union, types.UnionType):
        members = [a for a in get_args(annotation) if a is not type(None)]
        if len(members) == 1 and len(get_args(annotation)) == 2:
            return members[0], True
    return annotation, False
