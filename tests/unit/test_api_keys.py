"""API key records (``producer.api_keys.KeyRecord``): a key is refused at ``add`` naming
the field and its value; the record stored in Redis reads back as the same record, and a
record as the previous version wrote it (a plain JSON object) still authenticates."""

import asyncio
import re
import uuid

import orjson
import pytest

from lorapool.lifecycle.keys import Keys
from lorapool.producer.api_keys import ApiKeys, authenticate, key_sha256


@pytest.fixture
def store(conn):
    keys = Keys(f"test-keys-{uuid.uuid4().hex[:10]}")
    yield ApiKeys(conn, keys)
    conn.delete(keys.api_keys)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("acme", "boss"), "role must be one of 'admin', 'audit', 'submit', got 'boss'"),
        (("acme", True), "role must be one of 'admin', 'audit', 'submit', got True"),
        (("acme", "submit", None, 0), "rpm must be an integer >= 1, got 0"),
        (("acme", "submit", None, True), "rpm must be an integer >= 1, got True"),
        (("acme", "submit", None, None, 2.5), "tpm must be an integer >= 1, got 2.5"),
        (("acme", "submit", None, None, None, "yes"), "all_tenants must be true or false"),
        (("acme", "submit", None, None, None, True), "only an audit key may read all tenants"),
        (("a b", "submit"), "tenant 'a b' is not 1 to 64 letters, digits, '.', '_' and '-'"),
        (("a\x00", "submit"), "tenant 'a\\x00' is not 1 to 64 letters"),
        (("x" * 65, "submit"), "is not 1 to 64 letters"),
        ((7, "submit"), "tenant 7 is not 1 to 64 letters"),
    ],
)
def test_a_bad_key_is_refused_naming_the_field_and_value(store, conn, args, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        store.add(*args)
    assert not conn.exists(store.keys.api_keys)  # nothing stored


def test_the_stored_record_reads_back_and_authenticates(store, redis_url):
    import redis.asyncio

    record, key = store.add("acme", "audit", ["ad-b", "ad-a", "ad-a"], rpm=5, all_tenants=True)
    assert record.adapters == ["ad-a", "ad-b"] and record.sha256 == key_sha256(key)
    assert store.list() == [record]

    async def found(k: str):
        client = redis.asyncio.Redis.from_url(redis_url)
        try:
            return await authenticate(client, store.keys, k)
        finally:
            await client.aclose()

    assert asyncio.run(found(key)) == record
    assert asyncio.run(found(key[:-1] + ("A" if key[-1] != "A" else "B"))) is None
    assert store.revoke(record.id) and asyncio.run(found(key)) is None


def test_a_record_the_previous_version_wrote_still_authenticates(store, conn, redis_url):
    """The previous writer stored a plain JSON object (orjson), its ``created`` a float;
    a field a later version adds is ignored."""
    import redis.asyncio

    key_id = "0123456789abcdef"
    key = f"lp_{key_id}_{'k' * 43}"
    old = {"id": key_id, "tenant": "acme", "role": "submit", "adapters": None, "rpm": None,
           "tpm": 7, "all_tenants": False, "sha256": key_sha256(key), "created": 1.5,
           "later": {"x": 1}}  # fmt: skip
    conn.hset(store.keys.api_keys, key_id, orjson.dumps(old))

    async def found():
        client = redis.asyncio.Redis.from_url(redis_url)
        try:
            return await authenticate(client, store.keys, key)
        finally:
            await client.aclose()

    record = asyncio.run(found())
    assert (record.tenant, record.role, record.tpm, record.created) == ("acme", "submit", 7, 1.5)
