"""Pieces shared by the sync and async producers (building and submitting a job is
``lorapool.lifecycle.submit``'s)."""

from __future__ import annotations

from typing import Any


def distinct(values: list) -> tuple[list, list[int]]:
    """The distinct items of ``values`` (strings by value, anything else by identity:
    ``per_prompt`` repeats one object) and, for each item, the index of its own among
    them: a batch of prompts for one adapter resolves it once, not once a prompt."""
    firsts: dict[Any, int] = {}
    unique, at = [], []
    for value in values:
        key = value if isinstance(value, str) else id(value)
        if key not in firsts:
            firsts[key] = len(unique)
            unique.append(value)
        at.append(firsts[key])
    return unique, at


def per_prompt(value: Any, count: int, what: str) -> list:
    """``value`` repeated, or the list of one per prompt."""
    if isinstance(value, list):
        if len(value) != count:
            raise ValueError(f"{len(value)} {what} for {count} prompts")
        return value
    return [value] * count
