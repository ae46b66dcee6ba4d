"""A chat job's ``messages``: the one check of their shape and size. Torch-free.

The gateway needs no tokenizer: a chat job carries its messages, and the worker
applies the model's chat template (``lorapool.worker.prompt``).
"""

from __future__ import annotations

from typing import Any

from lorapool.protocol import FieldError, short_repr

MAX_MESSAGES = 4096
MAX_ROLE = 64


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise FieldError(message)


def check_messages(messages: Any, max_prompt_bytes: int) -> list[dict[str, str]] | None:
    """The messages of a chat (None: not a chat), or FieldError naming the bad field.

    1 to MAX_MESSAGES objects with exactly ``role`` (1 to MAX_ROLE characters, no
    NUL) and ``content`` (a string); their UTF-8 size counts against
    ``max_prompt_bytes`` as a prompt's does.
    """
    if messages is None:
        return None
    if not (isinstance(messages, list) and 0 < len(messages) <= MAX_MESSAGES):
        raise FieldError(
            f"messages must be a list of 1 to {MAX_MESSAGES} messages, got {short_repr(messages)}"
        )
    size = sum(_message_size(i, m) for i, m in enumerate(messages))
    _check(
        size <= max_prompt_bytes,
        f"the prompt is {size} bytes, over the limit of {max_prompt_bytes} (max_prompt_bytes)",
    )
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def _message_size(i: int, message: Any) -> int:
    if not (isinstance(message, dict) and set(message) == {"role", "content"}):
        raise FieldError(
            f"messages[{i}] must be an object with exactly 'role' and 'content', "
            f"got {short_repr(message)}"
        )
    role, content = message["role"], message["content"]
    if not (isinstance(role, str) and 0 < len(role) <= MAX_ROLE and "\x00" not in role):
        raise FieldError(
            f"messages[{i}].role must be a non-empty string of at most {MAX_ROLE} characters "
            f"without NUL, got {short_repr(role)}"
        )
    if not isinstance(content, str):
        raise FieldError(f"messages[{i}].content must be a string, got {short_repr(content)}")
    return len(role) + utf8_size(content, f"messages[{i}].content")


def utf8_size(text: str, what: str) -> int:
    """Bytes of ``text`` in UTF-8; FieldError naming ``what`` for lone surrogates."""
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise FieldError(
            f"{what} is not valid Unicode text ({exc.reason} at position {exc.start})"
        ) from None
