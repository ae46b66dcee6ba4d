"""Redis clients that ride out a stall or a restart: one set of options for every role.

Workers, producers and the audit writer connect through ``connect`` (sync) or
``connect_async``: redis-py retries a command that failed on a broken
connection (ConnectionError, TimeoutError, a server still loading its AOF)
with jittered exponential backoff, reconnecting each time; a health check
pings a connection idle for ``health_check_interval`` seconds before reuse; TCP
keepalive notices a peer that vanished. A producer's call retries long enough
to span a restart (``RETRIES``); workers and the audit writer retry only a
blip (``LOOP_RETRIES``): what outlasts that reaches their loops, which back off
and go on, logging it (see ``Worker.run_guarded`` and ``AuditWriter._retry``).
"""

from __future__ import annotations

import asyncio
import copy
import logging
import re
import time
from typing import Any
from urllib.parse import urlsplit

import redis
from redis.asyncio import RedisCluster as AsyncRedisCluster
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import EqualJitterBackoff

logger = logging.getLogger(__name__)

# A Redis Cluster away for a moment: CLUSTERDOWN (a master restarted refuses commands
# for its first 2 s; a node failed and not yet replaced), TRYAGAIN (a slot migrating).
CLUSTER_AWAY = (redis.exceptions.ClusterDownError, redis.exceptions.TryAgainError)
# Redis away (a stall, a restart, a cluster between slot maps: SlotNotCoveredError,
# which is not a RedisError): loops ride these out; other errors are the caller's.
REDIS_DOWN = (
    redis.ConnectionError,
    redis.TimeoutError,
    *CLUSTER_AWAY,
    redis.exceptions.SlotNotCoveredError,
)
# A cluster client's own errors, which are no RedisError (its failure to learn the slots)
CLUSTER_ERRORS = (redis.exceptions.RedisClusterException, redis.exceptions.SlotNotCoveredError)
REDIS_TRANSIENT = REDIS_DOWN  # the readers' name for it
SOCKET_TIMEOUT_S = 10.0  # above every blocking read's BLOCK (worker 0.1 s, client 1 s)
# Producers: waits of 0.2, 0.4, 0.8, 1.6, 2, 2 s (half of each jittered): 3.5 to 7 s of
# refused connections, a restart; in a stall each try also waits SOCKET_TIMEOUT_S.
RETRIES = 6
# Workers and the audit writer: a blip only; their loops back off, log and heed SIGTERM.
LOOP_RETRIES = 2
ASYNC_CONNECTIONS = 64  # an asyncio client's connections at most (``connect_async``)


def _failure_logger(retries: int):
    """Logs a call's first failed try as a warning, the others at debug level."""
    tries = []

    def log(error: Exception) -> None:
        tries.append(error)
        level = logging.WARNING if len(tries) == 1 else logging.DEBUG
        logger.log(
            level,
            "Redis call failed, retrying (up to %d times): %s: %s",
            retries,
            type(error).__name__,
            error,
        )

    return log


class LoggedRetry(redis.retry.Retry):
    """redis-py's Retry that logs failed tries: a stall it rides out shows in the log."""

    def call_with_retry(self, do, fail, is_retryable=None, with_failure_count=False):
        log = _failure_logger(self.get_retries())

        def logged(error, *count):
            log(error)
            return fail(error, *count)

        return super().call_with_retry(do, logged, is_retryable, with_failure_count)


class LoggedAsyncRetry(AsyncRetry):
    """``LoggedRetry`` for redis.asyncio clients."""

    async def call_with_retry(self, do, fail, is_retryable=None, with_failure_count=False):
        log = _failure_logger(self.get_retries())

        async def logged(error, *count):
            log(error)
            return await fail(error, *count)

        return await super().call_with_retry(do, logged, is_retryable, with_failure_count)


def connection_options(
    url: str = "redis://", retries: int = RETRIES, retry_class: type = LoggedRetry
) -> dict[str, Any]:
    """Keyword arguments of ``Redis.from_url(url)`` shared by all of lorapool's clients.

    TCP keepalive only for TCP URLs: a unix socket connection refuses the option.
    """
    options = {
        "retry": retry_class(EqualJitterBackoff(cap=2.0, base=0.1), retries),
        "retry_on_error": [redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError],
        "health_check_interval": 10,
        "socket_timeout": SOCKET_TIMEOUT_S,
        "socket_connect_timeout": 5.0,
    }
    if urlsplit(url).scheme in ("redis", "rediss"):
        options["socket_keepalive"] = True
    return options


def _cluster_unreachable(exc: BaseException) -> bool:
    """Whether ``exc`` is a cluster client's failure to learn the slots because its
    startup node was away (stalled past the socket timeout, restarting, CLUSTERDOWN):
    redis-py raises RedisClusterException "cannot be connected" from the node's
    ConnectionError/TimeoutError. Other RedisClusterExceptions (cluster mode off, nodes
    that disagree on the slots) are configuration errors, not retried."""
    if isinstance(exc, REDIS_DOWN):
        return True
    return isinstance(exc, redis.exceptions.RedisClusterException) and isinstance(
        exc.__cause__, REDIS_DOWN
    )


def _backoff() -> EqualJitterBackoff:
    return EqualJitterBackoff(cap=2.0, base=0.1)


def _cluster_client(url: str, options: dict[str, Any], retries: int) -> redis.RedisCluster:
    """``RedisCluster.from_url``, riding out its startup node being away as a call
    would (``retries`` tries more, with the same backoff, each logged).

    redis-py's cluster client asks its startup node (the URL's) for the slots in its
    constructor, once, outside any retry: a producer made while that master was stalled
    failed with RedisClusterException after one socket timeout, and one made while it
    restarted failed at once, where a standalone client rides both out. (Once the
    slots are known, redis-py adds every node it learned to its startup nodes.)"""
    backoff, log = _backoff(), _failure_logger(retries)
    for failures in range(1, retries + 2):
        try:
            return redis.RedisCluster.from_url(url, **options)
        except (redis.RedisError, *CLUSTER_ERRORS) as exc:
            if failures > retries or not _cluster_unreachable(exc):
                raise
            log(exc)
            time.sleep(backoff.compute(failures))
    raise AssertionError("unreachable")


class AsyncCluster(AsyncRedisCluster):
    """redis.asyncio's RedisCluster, which learns the slots before it routes a command.

    redis-py (8.1) picks a command's node before it learns the cluster's slots (on the
    first command, and again after it dropped them, say after a burst of MOVED): a
    command sent then goes to a random node. With many commands in flight at once
    (``run_scripts_async``, a follower's reads) the MOVED replies that follow make it
    drop its connections, those in use by other commands included (an
    ``AttributeError`` on a ``None`` writer, or a read that never returns). redis-py
    asks asyncio users to ``await initialize()`` first; this does it before every
    command (a no-op once the slots are known), riding out a startup node that is
    away as ``_cluster_client`` does (redis-py's initialize is outside its retry)."""

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        if not self._initialize:
            return await super().execute_command(*args, **kwargs)
        retries = self.retry.get_retries()
        backoff, log = _backoff(), _failure_logger(retries)
        for failures in range(1, retries + 2):
            try:
                await self.initialize()
                break
            except (redis.RedisError, *CLUSTER_ERRORS) as exc:
                if failures > retries or not _cluster_unreachable(exc):
                    raise
                log(exc)
                await asyncio.sleep(backoff.compute(failures))
        return await super().execute_command(*args, **kwargs)


CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}


def is_cluster(url: str) -> bool:
    """Whether ``url`` names a Redis Cluster: ``redis+cluster://`` (``rediss+cluster://``
    with TLS) and the address of any of its nodes, as ``redis+sentinel://`` names a
    Sentinel setup elsewhere. Said in the URL, not asked of the server: a client made
    while Redis is down connects later, as any other."""
    return urlsplit(url).scheme in CLUSTER_SCHEMES


def _node_url(url: str) -> str:
    """A cluster URL as redis-py takes it (the plain scheme)."""
    scheme, rest = url.split("://", 1)
    return f"{CLUSTER_SCHEMES[scheme]}://{rest}"


def connect(url: str, retries: int = RETRIES, **overrides: Any) -> redis.Redis:
    """A client of ``url`` with lorapool's retry, health-check and timeout options; a
    ``RedisCluster`` for a cluster URL (``is_cluster``)."""
    if is_cluster(url):
        url = _node_url(url)
        options = {**connection_options(url, retries), **overrides}
        return _cluster_client(url, _cluster_options(options), retries)
    return redis.Redis.from_url(url, **{**connection_options(url, retries), **overrides})


def connect_async(
    url: str,
    retries: int = RETRIES,
    max_connections: int | None = None,
    pool_timeout: float | None = None,
    **overrides: Any,
):
    """The asyncio client of ``url`` with the same options (``AsyncCluster`` for a
    cluster URL).

    Standalone, its pool holds up to ``max_connections`` (default
    ``ASYNC_CONNECTIONS``) and a call past them waits for a free one (at most
    ``pool_timeout`` seconds, then ConnectionError; None: as long as it takes). redis-py's
    default pool opens a connection per call in flight: an ``AsyncProducer``
    following 256 new requests at once opened 256, and each costs Redis an accept,
    a HELLO and a close (`lorapool bench queue_readers`, 256 streams: the readers'
    Redis CPU per chunk 5.7-10.2 µs with them, 2.2-4.3 with 64); past 100 it refuses
    the call. A cluster client keeps a pool per node (redis-py's, unless
    ``max_connections``).
    """
    from redis.asyncio import BlockingConnectionPool, Redis

    if is_cluster(url):
        url = _node_url(url)
        options = {**connection_options(url, retries, LoggedAsyncRetry), **overrides}
        if max_connections is not None:
            options["max_connections"] = max_connections
        return AsyncCluster.from_url(url, **_cluster_options(options))
    options = {**connection_options(url, retries, LoggedAsyncRetry), **overrides}
    pool = BlockingConnectionPool.from_url(
        url, max_connections=max_connections or ASYNC_CONNECTIONS, timeout=pool_timeout, **options
    )
    client = Redis(connection_pool=pool)
    client.auto_close_connection_pool = True  # closed with the client
    return client


def _cluster_options(options: dict[str, Any]) -> dict[str, Any]:
    """A cluster client retries a moved or failed node itself (``retry`` is its own);
    the per-connection options carry over."""
    return {
        k: v for k, v in options.items() if k not in ("retry_on_error", "health_check_interval")
    }


def is_cluster_client(connection: Any) -> bool:
    """Whether ``connection`` is a Redis Cluster client (sync or asyncio)."""
    from redis.asyncio import RedisCluster

    return isinstance(connection, (redis.RedisCluster, RedisCluster))


def is_async_client(connection: Any) -> bool:
    """Whether ``connection`` is a redis.asyncio client (standalone or cluster)."""
    from redis.asyncio import Redis, RedisCluster

    return isinstance(connection, (Redis, RedisCluster))


def register_script(connection: Any, text: str):
    """``connection.register_script(text)``. On a Redis Cluster the script runs under
    the ``#!lua`` shebang, with which Redis refuses any key outside the slot of the
    keys a call declared (without it, a key of another slot that the same node holds
    goes through, and breaks once the slots move): a key a script names without
    declaring it, on another shard, fails at once in the cluster tests. (Not on a
    standalone Redis: it does not check.)"""
    if is_cluster_client(connection):
        text = "#!lua\n" + text.lstrip("\n")
    return connection.register_script(text)


def client_for(connection: Any, key: str) -> Any:
    """``connection``, or on a Redis Cluster the client of the node that holds ``key``'s
    slot: what redis-py's cluster client does not carry (a pipeline of script calls,
    WATCH/MULTI) goes there, for keys of that one slot."""
    if isinstance(connection, redis.RedisCluster):
        return connection.get_redis_connection(connection.get_node_from_key(key))
    return connection


def run_scripts(connection, script, calls: list[dict[str, list]]) -> list:
    """``script(**call)`` for each call, pipelined: one round trip on a standalone
    Redis; on a Redis Cluster one per node (a call's keys are on one slot; redis-py's
    cluster pipeline refuses scripts, so each node's calls go on a pipeline of that
    node's own client). The results in the order of ``calls``."""
    groups: dict[Any, list[int]] = {}
    for i, call in enumerate(calls):
        groups.setdefault(client_for(connection, call["keys"][0]), []).append(i)
    results: list = [None] * len(calls)
    for client, where in groups.items():

        def run(client=client, where=where) -> list:
            with client.pipeline(transaction=False) as pipe:
                for i in where:
                    script(**calls[i], client=pipe)
                return pipe.execute()

        for i, result in zip(where, on_node(connection, run)):
            results[i] = result
    return results


def on_node(connection, call):
    """``call()``, which runs commands on a node's own client (``client_for``): on a
    Redis Cluster with the cluster client's retry (``connect``'s: backoff, logged),
    which redis-py gives only to the cluster client's own commands, its node clients
    having none (a node stalled past the socket timeout, or restarting, failed the
    call at once); CLUSTERDOWN and TRYAGAIN are retried too (a restarted master
    refuses commands for its first 2 s). Retried whole, as a standalone client
    retries a pipeline: what it runs must be idempotent."""
    if not isinstance(connection, redis.RedisCluster):
        return call()
    retry = copy.copy(connection.retry)
    retry.update_supported_errors(CLUSTER_AWAY)
    return retry.call_with_retry(call, lambda error: None)


async def run_scripts_async(connection, script, calls: list[dict[str, list]]) -> list:
    """``run_scripts`` for redis.asyncio clients (on a cluster, the calls at once)."""
    from redis.asyncio import RedisCluster

    if isinstance(connection, RedisCluster):
        import asyncio

        return list(await asyncio.gather(*(script(**call) for call in calls)))
    async with connection.pipeline(transaction=False) as pipe:
        for call in calls:
            await script(**call, client=pipe)
        return await pipe.execute()


# Redis's refusal of a write at maxmemory (noeviction) from inside a script; redis-py
# raises the plain command's as OutOfMemoryError
OUT_OF_MEMORY = "OOM command not allowed"


def out_of_memory(exc: BaseException) -> bool:
    """Whether Redis refused a call because it is at maxmemory (a script's call too)."""
    return isinstance(exc, redis.OutOfMemoryError) or (
        isinstance(exc, redis.ResponseError) and OUT_OF_MEMORY in str(exc)
    )


def ensure_group(connection: redis.Redis, stream: str, group: str) -> None:
    """Create ``group`` on ``stream`` (and the stream), reading from its start, unless it exists."""
    try:
        connection.xgroup_create(stream, group, id="0", mkstream=True)
    except redis.ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


# What Redis says when a user's ACL refuses a command, a key or a channel (directly, or
# in a script it runs)
_REFUSED = re.compile(
    r"no permissions to|can't run this command|can't access at least one of the", re.I
)


def refusal(exc: BaseException) -> str | None:
    """One line saying what the Redis user's ACL refused, for an operator (None when
    ``exc`` is no ACL refusal): the command's role needs a user with those rights."""
    if not isinstance(exc, redis.ResponseError) or not _REFUSED.search(str(exc)):
        return None
    said = str(exc).split(" script:")[0].rstrip(".")
    return (
        f"Redis refused this user: {said} (NOPERM); connect as the user of this "
        "command's role, or give it that right (docs/redis-acl.md)"
    )
