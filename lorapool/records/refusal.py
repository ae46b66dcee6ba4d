"""A body its Struct refused (an OpenAI request body: ``openai.bodies``; an API key's
record: ``records.api_key``), worded for the one who sent it: a FieldError whose
``field`` is the body's own parameter, the message naming where in it the problem lies,
what the type there accepts (read from the same Struct: ``msgspec.inspect``) and the
value given. msgspec's error text is read once, by ``records.errors.msgspec_path``.

Only refused bodies come here: nothing of this runs on a body that parses.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec
import msgspec.inspect as mi

from lorapool.records.errors import ANY_VALUE as _VALUE
from lorapool.records.errors import FieldError, msgspec_path, short_repr

_FIELD = re.compile(r"(?:unknown|missing required) field `([^`]*)`")
_INERT = {"best_of", "suffix", "audio", "web_search_options"}  # accepted when null only


def refused(message: str, body: Any, kind: type) -> FieldError:
    """The FieldError of msgspec's ``message`` refusing ``body`` as ``kind``; its
    ``field``: the body's parameter at fault (None: the body as a whole)."""
    text, key, steps = msgspec_path(message)
    if field := _FIELD.search(text):
        steps.append(field.group(1))
    if not steps:
        got = _value_at(body, [])
        got = text if got is _MISSING else f"got {short_repr(got)}"
        return FieldError(f"the request body must be a JSON object, {got}", field=None)
    param, where = str(steps[0]), _where(steps)
    if "unknown field" in text:
        return FieldError(f"unknown parameter {short_repr(where)}", field=param)
    if "missing required" in text:
        return FieldError(f"{where} is required", field=param)
    value = _value_at(body, steps)
    if param in _INERT and len(steps) == 1:
        return FieldError(f"{param} is not supported, got {short_repr(value)}", field=param)
    wanted = _type_at(mi.type_info(kind), steps)
    if wanted is None and text.startswith("Invalid value"):  # a tag: the kind of an object
        wanted = _tags(_type_at(mi.type_info(kind), steps[:-1]), steps[-1])
    if key and isinstance(dict_type := _concrete(wanted, _VALUE), mi.DictType):
        where, wanted, value = f"{where} keys", dict_type.key_type, _MISSING
    if wanted is None or not text.startswith(("Expected", "Invalid enum", "Invalid value")):
        return FieldError(f"{where}: {text[:1].lower()}{text[1:]}", field=param)
    got = "" if value is _MISSING else f", got {short_repr(value)}"
    return FieldError(f"{where} must be {describe(_member(wanted, value))}{got}", field=param)


def _where(steps: list) -> str:
    return str(steps[0]) + "".join(
        f"[{s}]" if isinstance(s, int) else " values" if s == _VALUE else f".{s}" for s in steps[1:]
    )


_MISSING = object()


def _value_at(body: Any, steps: list) -> Any:
    """The value at ``steps`` in ``body`` (JSON bytes are read again); _MISSING where
    it cannot be found."""
    if isinstance(body, bytes | bytearray | memoryview):
        try:
            body = msgspec.json.decode(body)
        except msgspec.DecodeError:
            return _MISSING
    for step in steps:
        try:
            body = body[step]
        except (KeyError, IndexError, TypeError):
            return _MISSING
    return body


def _type_at(info: mi.Type, steps: list) -> mi.Type | None:
    """The type the Struct wants at ``steps`` (None where no single one does)."""
    for step in steps:
        info = _concrete(info, step)
        if isinstance(info, mi.StructType) and isinstance(step, str):
            info = next((f.type for f in info.fields if f.name == step), None)
        elif isinstance(info, mi.ListType) and isinstance(step, int):
            info = info.item_type
        elif isinstance(info, mi.DictType) and step == _VALUE:
            info = info.value_type
        else:
            return None
    return info


def _concrete(info: mi.Type, step: Any) -> mi.Type:
    """``info`` without its description, and the member of a union that ``step`` enters
    (of several objects, the one with that field)."""
    info = _plain(info)
    if not isinstance(info, mi.UnionType):
        return info
    if step == _VALUE:
        enters = [m for m in _members(info) if isinstance(m, mi.DictType)]
    elif isinstance(step, str):
        enters = [m for m in _members(info) if isinstance(m, mi.StructType)]
        enters = [m for m in enters if any(f.name == step for f in m.fields)] or enters
    else:
        enters = [m for m in _members(info) if isinstance(m, mi.ListType)]
    return enters[0] if enters else info


def _tags(info: mi.Type | None, field: Any) -> mi.Type | None:
    """The values ``field`` may take as the tag of the objects of a union ``info``."""
    info = _plain(info) if info is not None else None
    members = _members(info) if isinstance(info, mi.UnionType) else []
    tags = [m.tag for m in members if isinstance(m, mi.StructType) and m.tag_field == field]
    return mi.LiteralType(tuple(tags)) if tags else None


def _members(union: mi.UnionType) -> list[mi.Type]:
    """A union's types, unions in it flattened, descriptions dropped."""
    out = []
    for member in map(_plain, union.types):
        out += _members(member) if isinstance(member, mi.UnionType) else [member]
    return out


_JSON_TYPES = {
    mi.StrType: str,
    mi.ListType: list,
    mi.DictType: dict,
    mi.StructType: dict,
    mi.IntType: int,
    mi.FloatType: (int, float),
    mi.BoolType: bool,
}


def _member(info: mi.Type, value: Any) -> mi.Type:
    """The member of a union ``info`` that ``value``'s JSON type selects (the one whose
    bound it passes), else ``info``."""
    if not isinstance(_plain(info), mi.UnionType):
        return info
    members = [m for m in _members(_plain(info)) if _is(value, type(m))]
    return members[0] if len(members) == 1 else info


def _is(value: Any, kind: type) -> bool:
    if isinstance(value, bool):
        return kind is mi.BoolType
    return isinstance(value, _JSON_TYPES.get(kind, ()))


def _plain(info: mi.Type) -> mi.Type:
    while isinstance(info, mi.Metadata):
        info = info.type
    return info


_NOUNS = {
    mi.IntType: ("an integer", "integers"),
    mi.FloatType: ("a number", "numbers"),
    mi.StrType: ("a string", "strings"),
    mi.BoolType: ("true or false", "booleans"),
    mi.ListType: ("a list", "lists"),
    mi.DictType: ("an object", "objects"),
    mi.StructType: ("an object", "objects"),
    mi.AnyType: ("any JSON value", "JSON values"),
}
_UNITS = {mi.StrType: "characters", mi.DictType: "entries"}


def describe(info: mi.Type, plural: bool = False) -> str:
    """What a value of type ``info`` is, in words: ``a non-empty string of at most 1024
    characters``, ``an integer in [0, 2147483647]``, ``a list of at most 64 ...``."""
    info = _plain(info)
    if isinstance(info, mi.UnionType):
        members = [m for m in _members(info) if not isinstance(m, mi.NoneType)]
        return " or ".join(dict.fromkeys(describe(m, plural) for m in members))
    if isinstance(info, mi.LiteralType):
        return "one of " + ", ".join(map(repr, info.values))
    if isinstance(info, mi.NoneType):
        return "null"
    if isinstance(info, mi.StructType) and info.tag is not None:
        return f"{'objects' if plural else 'an object'} of {info.tag_field} {info.tag!r}"
    one, many = _NOUNS.get(type(info), ("a value", "values"))
    noun = many if plural else one
    if getattr(info, "min_length", None) == 1:
        noun = ("non-empty " if plural else "a non-empty ") + noun.split(" ", 1)[-1]
    words = [noun, _range(info)]
    if isinstance(info, mi.ListType):
        words += ["of", _length(info, describe(info.item_type, plural=True))]
    elif isinstance(info, mi.StrType | mi.DictType):
        words.append(_length(info, _UNITS[type(info)], "of "))
    if getattr(info, "pattern", None):
        words.append(f"matching {info.pattern!r}")
    return " ".join(w for w in words if w)


def _range(info: mi.Type) -> str:
    lo, hi = getattr(info, "ge", None), getattr(info, "le", None)
    above, below = getattr(info, "gt", None), getattr(info, "lt", None)
    if (lo is not None or above is not None) and (hi is not None or below is not None):
        left = f"[{lo}" if lo is not None else f"({above}"
        right = f"{hi}]" if hi is not None else f"{below})"
        return f"in {left}, {right}"
    for bound, sign in ((lo, ">="), (above, ">"), (hi, "<="), (below, "<")):
        if bound is not None:
            return f"{sign} {bound}"
    return ""


def _length(info: mi.Type, unit: str, of: str = "") -> str:
    """``of at most 64 {unit}`` (``of``: the preposition; "" where none is needed)."""
    most, least = info.max_length, info.min_length
    if most is not None:
        return f"{of}at most {most} {unit}"
    if least is not None and least > 1:
        return f"{of}at least {least} {unit}"
    return unit if not of else ""
