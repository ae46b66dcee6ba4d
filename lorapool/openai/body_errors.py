"""A request body that its Struct (``bodies``) refused, as OpenAI's 400: ``param`` the
request's own parameter. The wording (where in the body, what the type there accepts,
the value given) is ``records.refusal``'s, shared with every other refused body.
"""

from __future__ import annotations

from typing import Any

from lorapool.openai.errors import APIError, bad_request
from lorapool.records.refusal import refused


def invalid(message: str, body: Any, kind: type) -> APIError:
    """The 400 of msgspec's ``message`` refusing ``body`` as ``kind``."""
    error = refused(message, body, kind)
    return bad_request(str(error), error.field)
