"""Pieces shared by the sync and async producers (building and submitting a job is
``lorapool.lifecycle.submit``'s)."""

from __future__ import annotations

from typing import Any


def per_prompt(value: Any, count: int, what: str) -> list:
    """``value`` repeated, or the list of one per prompt."""
    if isinstance(value, list):
        if len(value) != count:
            raise ValueError(f"{len(value)} {what} for {count} prompts")
        return value
    return [value] * count
