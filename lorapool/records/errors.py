"""FieldError: a field of a request of the wrong type or out of range, named in words and
by its path (``.field``), and the one translation of msgspec's validation errors into it.

msgspec checks a record's types and bounds (``lorapool.records.bounds``) in C and says what
failed and where (``Expected `int` >= 1 - at `$.sampling_params.n```); ``invalid``
turns that into the message every caller has read since the checks were hand-written
(``sampling_params.n must be an integer >= 1, got 0``), wording the bound from the same
alias msgspec enforced and quoting the value it refused. Torch-free: the standard
library and msgspec.
"""

from __future__ import annotations

import enum
import re
import reprlib
import types
import typing
from typing import Annotated, Any, get_args, get_origin

import msgspec

from lorapool.records.bounds import explain


class FieldError(ValueError):
    """A field of a job of the wrong type or out of range; the message names it and its value.

    ``field``: its path, as the message names it (``"sampling_params.seed"``,
    ``"prompt_token_ids[3]"``, ``"request_id"``; None when the message is about the job
    as a whole), for callers that map it to their own parameters without reading the
    text. ``request_id``: the job's, once the job boundary knows it (the message then
    starts ``job <request_id>: ``), so a caller of many jobs tells which one."""

    def __init__(self, message: str, request_id: str = "", field: str | None = None):
        super().__init__(message)
        self.request_id = request_id
        self.field = field


def check(ok: bool, message: str, field: str | None = None) -> None:
    if not ok:
        raise FieldError(message, field=field)


_SHORT = reprlib.Repr()  # (keyword arguments only from Python 3.12)
_SHORT.maxlevel, _SHORT.maxstring, _SHORT.maxother, _SHORT.maxlong = 2, 80, 80, 80
_SHORT.maxlist = _SHORT.maxtuple = _SHORT.maxdict = _SHORT.maxset = 8


def short_repr(value: Any, limit: int = 60) -> str:
    """A value for an error message: its repr, cut short (prompts can be megabytes, so
    only the first few items of a container or characters of a string are looked at)."""
    text = _SHORT.repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({type(value).__name__})"


_AT = re.compile(r" - at (`key` in )?`\$([^`]*)`$")
_STEP = re.compile(r"\.([^.\[]+)|\[(\d+)\]|(\[\.\.\.\])")
ANY_VALUE = "[...]"  # a step to any value of an object (msgspec does not say which)
_NOTHING = object()


def msgspec_path(message: str) -> tuple[str, bool, list[str | int]]:
    """msgspec's error text, read here only: what failed (``Expected `int` >= 1``),
    whether at an object's key rather than its value, and where, as steps: a field's
    name, a list's index, or ``ANY_VALUE``. ``$.a.b[3]`` is ``["a", "b", 3]``."""
    at = _AT.search(message)
    if at is None:
        return message, False, []
    steps = [
        name or (int(index) if index else ANY_VALUE)
        for name, index, _ in _STEP.findall(at.group(2))
    ]
    return message[: at.start()], at.group(1) is not None, steps


def path_text(steps: list[str | int]) -> str:
    """``msgspec_path``'s steps as a path: ``outputs[0].text``, ``metadata[...]``."""
    return "".join(
        f"[{s}]" if isinstance(s, int) else s if s == ANY_VALUE or not i else f".{s}"
        for i, s in enumerate(steps)
    )


def invalid(exc: msgspec.ValidationError, value: Any, tp: Any, root: str = "") -> FieldError:
    """The FieldError of msgspec's ``exc``, raised checking ``value`` (the record as
    Python objects, or ``_NOTHING`` when unknown) against type ``tp``; ``root``: the
    record's own name ahead of every path (``"sampling_params"``)."""
    if isinstance(exc.__cause__, FieldError):  # raised by a record's own check
        return exc.__cause__
    text, key, steps = msgspec_path(str(exc))
    where = root
    for step in steps:
        if step == ANY_VALUE:  # a dict's value: the first bad one
            args = get_args(_unannotated(_arm(tp, dict)))
            tp = args[1] if args else Any
            bad = _first_bad(value.items() if isinstance(value, dict) else (), tp, 1)
            key_of = "..." if bad is _NOTHING else bad[0]
            value, where = (_NOTHING if bad is _NOTHING else bad[1]), f"{where}[{key_of}]"
        elif isinstance(step, int):
            value, tp = _step(value, tp, step)
            where = f"{where}[{step}]"
        else:
            value, tp = _step(value, tp, step)
            where = f"{where}.{step}" if where else step
    if key:
        args = get_args(_unannotated(_arm(tp, dict)))
        tp = args[0] if args else Any
        bad = _first_bad(((k, k) for k in value) if isinstance(value, dict) else (), tp, 0)
        value = bad if bad is _NOTHING else bad[0]
    return FieldError(_sentence(text, where, value, tp, key), field=where or None)


def _first_bad(pairs: Any, tp: Any, which: int) -> Any:
    """The first pair whose item ``which`` msgspec refuses as a ``tp`` (``_NOTHING``: none)."""
    for pair in pairs:
        try:
            msgspec.convert(pair[which], tp, strict=which == 1)
        except msgspec.ValidationError:
            return pair
    return _NOTHING


def _sentence(text: str, where: str, value: Any, tp: Any, key: bool) -> str:
    got = "" if value is _NOTHING else f", got {short_repr(value)}"
    subject = f"{where} keys" if key else where
    if text.startswith("Object contains unknown field "):
        return f"unknown {where or 'job'} field(s): '{text.split('`')[1]}'"
    if text.startswith("Object missing required field "):
        return f"{where or 'the job'} needs {text.split('`')[1]}"
    if text.startswith("Invalid enum value"):
        literal = next((a for a in _arms(tp) if get_origin(a) is typing.Literal), None)
        if literal is not None:
            return f"{subject} must be one of {', '.join(map(repr, get_args(literal)))}{got}"
        enum_type = _arm(tp, enum.Enum)
        return f"{subject} must be one of {', '.join(e.value for e in enum_type)}{got}"
    if key:
        return f"{subject} must be {explain(tp)}{got}"
    if text.startswith("Expected `") and ", got `" in text:  # the wrong type
        texts = [a for a in _arms(tp) if _base(a) is str and get_origin(a) is Annotated]
        return f"{subject} must be {explain(texts[0]) if texts else _noun(tp)}{got}"
    if text.startswith("Expected `"):  # the right type out of its bounds
        bounded = next((a for a in _arms(tp) if get_origin(a) is Annotated), tp)
        return f"{subject} must be {explain(bounded)}{got}"
    return f"{subject}: {text}{got}"


def _arms(tp: Any) -> list[Any]:
    """The types a value of ``tp`` may have, None left out."""
    if get_origin(tp) in (typing.Union, types.UnionType):
        return [a for a in get_args(tp) if a is not type(None)]
    return [tp]


def _unannotated(tp: Any) -> Any:
    return get_args(tp)[0] if get_origin(tp) is Annotated else tp


def _base(tp: Any) -> Any:
    tp = _unannotated(tp)
    return get_origin(tp) or tp


def _arm(tp: Any, kind: type) -> Any:
    """The arm of union ``tp`` that is a ``kind`` (a Struct, list, dict or Enum)."""
    arms = _arms(tp)
    return next(
        (a for a in arms if isinstance(_base(a), type) and issubclass(_base(a), kind)), arms[0]
    )


def _step(value: Any, tp: Any, name: str | int) -> tuple[Any, Any]:
    """The value and type one step (a field's name, a list's index) into ``value``."""
    if isinstance(name, int):
        inner = get_args(_unannotated(_arm(tp, list)))
        ok = isinstance(value, (list, tuple)) and name < len(value)
        return (value[name] if ok else _NOTHING), (inner[0] if inner else Any)
    # a Struct, or a generic one's alias (messages.Message[Role, ShortName])
    struct = _arm(tp, msgspec.Struct)
    base = get_origin(struct) or struct
    hints = (
        {f.encode_name: f.type for f in msgspec.structs.fields(struct)}
        if (isinstance(base, type) and issubclass(base, msgspec.Struct))
        else {}
    )
    if isinstance(value, dict):
        value = value.get(name, _NOTHING)
    elif value is not _NOTHING:
        value = getattr(value, name, _NOTHING)
    return value, hints.get(name, Any)


def _noun(tp: Any) -> str:
    nouns = []
    for arm in _arms(tp):
        base = _base(arm)
        if base is bool:
            nouns.append("true or false")
        elif base is int:
            nouns.append("an integer")
        elif base is float:
            nouns.append("a finite number")
        elif base is str:
            nouns.append("a string")
        elif base is list:
            nouns.append("a list")
        elif isinstance(base, type) and issubclass(base, enum.Enum):
            nouns.append(f"one of {', '.join(e.value for e in base)}")
        elif base is dict or (isinstance(base, type) and issubclass(base, msgspec.Struct)):
            nouns.append("an object")
        else:
            nouns.append(f"a {getattr(base, '__name__', base)}")
    return " or ".join(nouns)
