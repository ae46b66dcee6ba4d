"""Whether the Redis a pool runs on keeps its state across a restart.

Workers and ``lorapool status`` warn at start when it does not: a restart then loses
every queued and running request and every result (their readers fail with
``JobLost``).
"""

from __future__ import annotations

from typing import Any

import redis

from lorapool.connection import CLUSTER_ERRORS, is_cluster_client


def _acl_username(connection: Any) -> str | None:
    """The ACL user ``connection`` logs in as (None: the default user, or unknown)."""
    try:
        if is_cluster_client(connection):
            node = connection.get_default_node()
            pool = node.redis_connection.connection_pool
        else:
            pool = connection.connection_pool
        return pool.connection_kwargs.get("username")
    except AttributeError:
        return None


def persistence_warning(connection: Any) -> str | None:
    """A warning when the Redis of ``connection`` keeps nothing across a restart (AOF
    off and no RDB snapshot rule): every queued and running request, every result,
    would be lost with it (its readers then fail with JobLost). None when it persists,
    or when this user may not ask (INFO and CONFIG GET refused: no guess). On a cluster,
    the first node that answers speaks for all.

    Under a named ACL user it does not ask at all: the roles of docs/redis-acl.md may
    not run INFO or CONFIG GET (CONFIG GET would show secrets), and each refused try
    would land in Redis's ACL LOG, where an operator looks for real attacks. The check
    runs for the default user (a dev box, the demo, compose without ACLs)."""
    if _acl_username(connection) not in (None, "", "default"):
        return None
    try:
        info = connection.info("persistence")
        if is_cluster_client(connection):  # {node: info}
            info = next(iter(info.values())) if info and "aof_enabled" not in info else info
        if int(info.get("aof_enabled", 0)):
            return None
        save = connection.config_get("save")
        if is_cluster_client(connection) and save and "save" not in save:
            save = next(iter(save.values()))
        if (save or {}).get("save"):
            return None
    except (redis.RedisError, *CLUSTER_ERRORS, StopIteration, AttributeError):
        return None
    return (
        "this Redis keeps no persistence (appendonly no, no RDB save rule): a restart "
        "loses every queued and running request and every result (docs/redis-memory.md)"
    )
