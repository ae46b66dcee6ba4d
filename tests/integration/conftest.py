"""Fixtures of the queue tests: a Redis connection and a key prefix of their own."""

import uuid

import pytest
import redis

from lorapool.producer import Producer


@pytest.fixture
def conn(redis_url):
    connection = redis.Redis.from_url(redis_url)
    yield connection
    connection.close()


@pytest.fixture
def prefix(conn):
    """A fresh key prefix; every key under it is deleted after the test."""
    prefix = f"test-{uuid.uuid4().hex[:10]}"
    yield prefix
    for key in conn.scan_iter(f"{prefix}:*"):
        conn.delete(key)


@pytest.fixture
def producer(conn, prefix):
    return Producer(conn, prefix=prefix)
