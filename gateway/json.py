"""JSON responses encoded with orjson (as the wire records are): fast, and exact for
any code point the audit trail stores."""

from __future__ import annotations

from typing import Any

import orjson
from starlette.responses import JSONResponse


class JSON(JSONResponse):
    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


def error_response(error) -> JSON:
    """An ``APIError`` (``lorapool.openai.errors``) as the gateway answers it."""
    return JSON(error.body(), status_code=error.status, headers=error.headers)
