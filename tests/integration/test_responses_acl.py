"""Stored responses (gateway/responses_store.py) with the Redis users of
docs/redis-acl.md, on a private redis-server: the gateway's user saves, reads and
deletes them; another role's may not read them."""

from __future__ import annotations

import asyncio

import pytest
import redis
from deployment_pool import acl_rules, set_users
from redis_server import RedisServer

from lorapool.connection import connect, connect_async
from lorapool.gateway.auth import Principal
from lorapool.gateway.responses_store import ResponseStore
from lorapool.lifecycle.keys import Keys
from lorapool.openai.errors import APIError

pytestmark = pytest.mark.integration
PASSWORD = "test-password-0123"


@pytest.fixture
def server(tmp_path):
    server = RedisServer(tmp_path / "redis").start()
    admin = server.client()
    set_users(admin, {line.split()[2]: PASSWORD for line in acl_rules().values()})
    admin.close()
    yield server
    server.stop()


def url(server, role: str) -> str:
    return server.url.replace("://", f"://lorapool-{role}:{PASSWORD}@", 1)


def test_the_gateway_stores_responses_with_its_user(server):
    keys, response = Keys(), {"id": "resp_acl", "object": "response", "output": []}

    async def round_trip() -> dict:
        client = connect_async(url(server, "gateway"))
        try:
            store = ResponseStore(client, keys, Principal("acme"))
            await store.save(response, [{"role": "user", "content": "x"}])
            record = await store.load("resp_acl")
            await store.delete("resp_acl")
            with pytest.raises(APIError):
                await store.load("resp_acl")
            return record
        finally:
            await client.aclose()

    assert asyncio.run(round_trip())["response"] == response
    exporter = connect(url(server, "exporter"))
    try:
        with pytest.raises(redis.exceptions.NoPermissionError):
            exporter.get(keys.response("acme~resp_acl"))
    finally:
        exporter.close()
