"""What a worker tells its pool: which base model it serves, and that it is alive."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import msgspec
import orjson
import redis

from lorapool.connection import REDIS_DOWN
from lorapool.lifecycle.keys import Keys
from lorapool.records.adapter import ModelIdentity, decode_model_identity
from lorapool.records.heartbeat import (
    Heartbeat,
    consumer_of,
    decode_heartbeats,
    encode_heartbeat,
)

if TYPE_CHECKING:
    from lorapool.worker.engine_api import EngineInterface
    from lorapool.worker.state import WorkerState

logger = logging.getLogger(__name__)


class ModelMismatchError(RuntimeError):
    """A worker's base model differs from the one its pool serves."""


def claim_model(connection: redis.Redis, keys: Keys, base_model: ModelIdentity) -> None:
    """Claim the pool for this base model, or refuse (ModelMismatchError) another one.

    The first worker of a pool records its model (``{p}:model``, SET NX); a
    worker whose weights differ would answer the pool's requests with another
    model, so it refuses to start, naming both.
    """
    try:
        connection.set(keys.model, msgspec.json.encode(base_model), nx=True)
        pool = decode_model_identity(connection.get(keys.model)) or base_model
    except (ValueError, redis.ResponseError) as exc:  # not what a worker wrote
        if isinstance(exc, redis.ResponseError) and not str(exc).startswith("WRONGTYPE"):
            raise  # Redis refusing the write (OOM, READONLY): the startup's waits have it
        raise ModelMismatchError(
            f"pool {keys.prefix!r}: {keys.model} holds no base model record ({exc}): "
            "delete it once no worker of the pool runs"
        ) from None
    if pool.sha256 != base_model.sha256:
        raise ModelMismatchError(
            f"pool {keys.prefix!r} serves base model {pool.name!r} "
            f"(sha256 {pool.sha256[:12]}…) and this worker has "
            f"{base_model.name!r} (sha256 {base_model.sha256[:12]}…): start it "
            f"on another --prefix, or delete {keys.model} once no worker of the old "
            "model runs"
        )


def publish_tokenizer(
    connection: redis.Redis, keys: Keys, engine: EngineInterface, base_model: ModelIdentity
) -> None:
    """The engine's tokenizer into ``{p}:tokenizer`` for the gateways' /tokenize (which load
    it with ``tokenizers``, no model files, no torch); an engine without a fast tokenizer
    publishes nothing. One worker of the pool writing it is enough; each rewrites it."""
    tokenizer = engine.get_tokenizer()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return
    special = {k: v for k, v in tokenizer.special_tokens_map.items() if isinstance(v, str)}
    record = {
        "sha256": base_model.sha256,
        "tokenizer": backend.to_str(),
        "chat_template": tokenizer.chat_template,
        "special": special,
        "clean_up_tokenization_spaces": bool(tokenizer.clean_up_tokenization_spaces),
    }
    connection.hset(
        keys.tokenizer, mapping={"sha256": record["sha256"], "record": orjson.dumps(record)}
    )


def heartbeat_record(state: WorkerState) -> Heartbeat:
    """The worker's row of ``lorapool status`` (and resets its token counter)."""
    engine, held = state.engine, state.held.values()
    tokens_per_s = state.tokens_per_s()
    running, waiting = engine.request_counts()
    limits = engine_limits(engine)
    return Heartbeat(
        name=state.name,
        consumer=state.consumer,
        device=engine.device_name,
        model=state.base_model.name,
        updated=state.tokens_since,
        running=running,
        waiting=waiting,
        held=len(held),
        tokens_per_s=tokens_per_s,
        adapters=sorted({h.job.lora_request.name for h in held if h.job.lora_request}),
        loaded=loaded_adapters(engine),
        draining=state.draining,
        max_model_len=limits.get("max_model_len"),
        max_logprobs=limits.get("max_logprobs"),
        kv_capacity_tokens=limits.get("kv_capacity_tokens"),
        kv_cache_usage=limits.get("kv_cache_usage"),
    )


def engine_limits(engine: EngineInterface) -> dict[str, Any]:
    """What the gateway checks at the door and the dashboard shows: the context length,
    ``max_logprobs``, the KV cache's token slots and the share in use (an engine that
    does not say: nothing)."""
    limits = dict(engine.request_limits())
    usage = engine.kv_cache_usage()
    if usage is not None:
        limits["kv_cache_usage"] = usage
    return limits


def loaded_adapters(engine: EngineInterface) -> list[str]:
    """The adapters in the engine's device slots."""
    return list(engine.lora_state().get("device", []))


def warn_same_name(state: WorkerState) -> None:
    """At start: log a warning naming the other live processes started with this
    worker's ``--name``. Allowed (each is its own consumer, fenced apart), but usually a
    supervisor's restart while the old process is frozen or partitioned: it will append
    nothing for the entries this one takes over, and says so when it wakes."""
    try:
        twins = same_name_alive(state.redis, state.keys, state.name, state.consumer)
    except (*REDIS_DOWN, redis.ResponseError):  # a warning, not a start's condition
        return
    if twins:
        logger.warning(
            "worker %s: another live process has this --name (%s); this one is %s, "
            "and each keeps its own entries",
            state.name,
            ", ".join(twins),
            state.consumer,
        )


def same_name_alive(connection: redis.Redis, keys: Keys, name: str, consumer: str) -> list[str]:
    """The consumers of other live processes that show the worker name ``name``."""
    records = decode_heartbeats(connection.hgetall(keys.workers))
    others = [c for c, h in records.items() if h.name == name and c != consumer]
    alive = connection.mget([keys.alive(c) for c in others]) if others else []
    return [c for c, flag in zip(others, alive) if flag is not None]


def send_heartbeat(
    connection: redis.Redis, keys: Keys, record: Heartbeat, alive_ttl_s: int
) -> list[Heartbeat]:
    """Store a worker's ``record`` and its ``{p}:alive:{consumer}`` flag, which expires
    ``alive_ttl_s`` later; returns the records of the pool's live workers."""
    with connection.pipeline(transaction=False) as pipe:
        pipe.hset(keys.workers, consumer_of(record), encode_heartbeat(record))
        pipe.set(keys.alive(consumer_of(record)), 1, ex=alive_ttl_s)
        pipe.hgetall(keys.workers)
        replies = pipe.execute(raise_on_error=False)
    for reply in replies:  # Redis away: the loop rides it out; other refusals are ours
        if isinstance(reply, REDIS_DOWN):
            raise reply
    records = replies[2]
    if isinstance(records, redis.ResponseError):
        # the workers' hash replaced (a producer may write it): no pool view, the worker
        # goes on as if alone (fair share of 1) until someone mends the key
        logger.warning("the workers' record %s is unusable (%s)", keys.workers, records)
        return []
    heartbeats = decode_heartbeats(records)
    alive = connection.mget([keys.alive(n) for n in heartbeats]) if heartbeats else []
    return [h for h, flag in zip(heartbeats.values(), alive) if flag is not None]
