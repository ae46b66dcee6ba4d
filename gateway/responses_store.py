"""Stored responses (``store``, true by default as OpenAI's): what ``GET
/v1/responses/{id}`` returns and ``previous_response_id`` continues.

One Redis string per response, ``Keys.response(<tenant>~resp_<id>)``: orjson
``{"response": the response object, "conversation": the chat's messages with the
reply, without the instructions, "input_items": the request's input as items (``GET
/v1/responses/{id}/input_items``)}``, and for a background response ``"background":
{"jobs": [its job's request id], "request": the request, "previous": how many messages
of the conversation came before it}`` (its status changes: ``lifecycle/response_settle``).
It expires ``RESPONSE_TTL_S`` after it was made (a day: long enough for an agent's
turns, short enough that a pool's Redis does not fill with conversations; OpenAI keeps
30 days). A tenant's id names its own key only, so another tenant's id is a 404.
"""

from __future__ import annotations

import re
from typing import Any

import orjson

from lorapool.gateway.auth import Principal
from lorapool.lifecycle.response_settle import Settle
from lorapool.openai.errors import APIError

RESPONSE_TTL_S = 24 * 3600
ID = re.compile(r"resp_[A-Za-z0-9_-]{1,100}")  # ours: resp_ and 32 hex digits


class ResponseStore:
    """A tenant's stored responses; ``items``: the input items of the response this
    store saves (``response_items.input_items``)."""

    def __init__(self, redis, keys, caller: Principal, items: list | None = None):
        self.redis, self.keys, self.caller = redis, keys, caller
        self.items = items or []

    def _key(self, response_id: str) -> str:
        return self.keys.response(self.caller.job_id(response_id))

    async def save(
        self, response: dict[str, Any], conversation: list[dict[str, Any]], **more: Any
    ) -> None:
        """Stores the response (``more``: further fields of its record)."""
        record = {"response": response, "conversation": conversation, "input_items": self.items}
        await self.redis.set(
            self._key(response["id"]), orjson.dumps({**record, **more}), ex=RESPONSE_TTL_S
        )

    async def settle(self, record: dict[str, Any]) -> bool:
        """``record`` replaces the stored one while its response is queued or in progress
        (a background response's status change); False when it has ended or expired."""
        key = self._key(record["response"]["id"])
        return await Settle(self.redis)(key, orjson.dumps(record))

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
