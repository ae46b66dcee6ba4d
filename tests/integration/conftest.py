"""Fixtures of the queue tests: a Redis connection and a key prefix of their own.

A pool layout: ``standalone`` (one Redis, ``shards=0``) or ``cluster`` (a real
3-master Redis Cluster, ``shards=3``, at ``$LORAPOOL_TEST_CLUSTER_URL``; skipped
without it). A module runs its tests on both by declaring
``LAYOUTS = ("standalone", "cluster")`` (``pytest_generate_tests`` below
parametrizes ``layout``), and a test of it narrows that with
``@pytest.mark.layouts("standalone")``; every other module stays on standalone,
unparametrized.
Fixtures that follow the layout: ``conn``, ``pool_url``, ``shards``, ``prefix``,
``keys`` and ``producer``; the cleanup deletes every key of the layout, on every node.
"""

import os
import uuid

import pytest
import redis

from lorapool.connection import connect
from lorapool.lifecycle.keys import Keys
from lorapool.producer import Producer

CLUSTER_SHARDS = 3
LAYOUT_NAMES = ("standalone", "cluster")


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "layouts(*names): the pool layouts a test of a LAYOUTS module runs on"
    )


def pytest_generate_tests(metafunc):
    layouts = getattr(metafunc.module, "LAYOUTS", None)
    if layouts is None or "layout" not in metafunc.fixturenames:
        return
    narrowed = metafunc.definition.get_closest_marker("layouts")
    if narrowed is not None:
        layouts = narrowed.args
    unknown = set(layouts) - set(LAYOUT_NAMES)
    assert not unknown, f"{metafunc.module.__name__}: unknown LAYOUTS {sorted(unknown)}"
    metafunc.parametrize("layout", layouts, indirect=True)


@pytest.fixture
def layout(request):
    """``standalone`` unless the module's ``LAYOUTS`` parametrize it."""
    name = getattr(request, "param", "standalone")
    if name == "cluster" and not os.environ.get("LORAPOOL_TEST_CLUSTER_URL"):
        pytest.skip("no LORAPOOL_TEST_CLUSTER_URL (a Redis Cluster node; .ci/redis-cluster)")
    return name


@pytest.fixture
def pool_url(layout, request):
    """The URL of the layout's Redis: ``redis_url``, or a node of the cluster."""
    if layout == "cluster":
        return os.environ["LORAPOOL_TEST_CLUSTER_URL"]
    return request.getfixturevalue("redis_url")


@pytest.fixture
def shards(layout):
    return CLUSTER_SHARDS if layout == "cluster" else 0


@pytest.fixture
def conn(layout, pool_url):
    """A client of the layout: ``redis.Redis``, or ``redis.RedisCluster``."""
    if layout == "cluster":
        connection = connect(pool_url)
        assert isinstance(connection, redis.RedisCluster)
    else:
        connection = redis.Redis.from_url(pool_url)
    yield connection
    connection.close()


@pytest.fixture
def prefix(conn, shards):
    """A fresh key prefix; every key under it is deleted after the test (on every
    node of a cluster: RedisCluster's SCAN goes to every primary)."""
    prefix = f"test-{uuid.uuid4().hex[:10]}"
    yield prefix
    for key in list(conn.scan_iter(match=Keys(prefix, shards).pattern)):
        conn.delete(key)


@pytest.fixture
def keys(prefix, shards):
    """The layout's key names (``keys.on(s)`` / ``keys.for_request(rid)`` per shard)."""
    return Keys(prefix, shards)


@pytest.fixture
def producer(conn, prefix, shards):
    return Producer(conn, prefix=prefix, shards=shards)


# --- the deployment conformance tests (test_deployment.py, test_compose.py) ---------


@pytest.fixture(scope="module")
def tree(tmp_path_factory, model):
    """The volumes: /models/base (the tiny model) and /adapters/ad (an adapter of it)."""
    from adapters import build_adapter

    root = tmp_path_factory.mktemp("volumes")
    (root / "models").mkdir()
    (root / "models" / "base").symlink_to(model)
    build_adapter(model, root / "adapters" / "ad", rank=8, seed=3, std=0.2)
    return root


@pytest.fixture(scope="module")
def audit_key_text():
    from lorapool import signing

    return signing.new_key()
