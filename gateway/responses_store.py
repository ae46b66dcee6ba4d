"""Stored responses (``store``, true by default as OpenAI's): what ``GET
/v1/responses/{id}`` returns and ``previous_response_id`` continues.

One Redis string per response, ``Keys.response(<tenant>~resp_<id>)``: orjson
``{"response": the response object, "conversation": the chat's messages with the
reply, without the instructions}``. It expires ``RESPONSE_TTL_S`` after it was made
(a day: long enough for an agent's turns, short enough that a pool's Redis does not
fill with conversations; OpenAI keeps 30 days). A tenant's id names its own key only,
so another tenant's id is a 404.
"""

from __future__ import annotations

import re
from typing import Any

import orjson

from lorapool.gateway.auth import Principal
from lorapool.openai.errors import APIError

RESPONSE_TTL_S = 24 * 3600
ID = re.compile(r"resp_[A-Za-z0-9_-]{1,100}")  # ours: resp_ and 32 hex digits


class ResponseStore:
    def __init__(self, redis, keys, caller: Principal):
        self.redis, self.keys, self.caller = redis, keys, caller

    def _key(self, response_id: str) -> str:
        return self.keys.response(self.caller.job_id(response_id))

    async def save(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        record = orjson.dumps({"response": response, "conversation": conversation})
        await self.redis.set(self._key(response["id"]), record, ex=RESPONSE_TTL_S)

    async def load(self, response_id: str, param: str | None = None) -> dict[str, Any]:
        """The stored record; 404 naming ``param`` (where the id was given) otherwise."""
        raw = None
        if ID.fullmatch(response_id):
            raw = await self.redis.get(self._key(response_id))
        if raw is None:
            raise not_found(response_id, param)
        return orjson.loads(raw)

    async def delete(self, response_id: str) -> None:
        if not ID.fullmatch(response_id) or not await self.redis.delete(self._key(response_id)):
            raise not_found(response_id)


def not_found(response_id: str, param: str | None = None) -> APIError:
    shown = response_id[:128]
    return APIError(404, f"Response with id {shown!r} not found.", param, code="not_found")
