"""A config dataclass checked against its own annotations.

A field's type and bounds are written once, on the field, as the constraint types of
``lorapool.bounds`` are (``max_n: NonNegative = 8``); :func:`check_fields`, called from
``__post_init__``, checks every value against them with msgspec (strict: a bool is no
integer, a string no number) and raises ValueError naming the field and its value,
its bound worded by ``bounds.explain`` ("max_n must be an integer >= 0, got -1").
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, get_type_hints

import msgspec

from lorapool.bounds import explain, meta_of


@functools.cache
def _annotations(cls: type) -> tuple[tuple[str, Any], ...]:
    hints = get_type_hints(cls, include_extras=True)
    return tuple((f.name, hints[f.name]) for f in dataclasses.fields(cls) if f.init)


def check_fields(config: object) -> None:
    """Each field of the dataclass ``config`` (those its ``__init__`` takes) against its
    annotation; ValueError for the first that does not fit."""
    for name, annotation in _annotations(type(config)):
        value = getattr(config, name)
        try:
            msgspec.convert(value, annotation)
        except msgspec.ValidationError as exc:
            if meta_of(annotation) is None:  # a plain type: msgspec's words
                raise ValueError(f"{name}={value!r}: {exc}") from None
            raise ValueError(f"{name} must be {explain(annotation)}, got {value!r}") from None
