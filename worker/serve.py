"""Start a worker from its configs: build the engine, identify the base model, run."""

from __future__ import annotations

import logging

import redis

from lorapool import heap
from lorapool.grammar_sandbox import GrammarSandbox
from lorapool.identity import model_identity
from lorapool.lifecycle.keys import Keys
from lorapool.startup import until_redis_takes
from lorapool.worker.config import WorkerConfig
from lorapool.worker.pool import claim_model, publish_tokenizer
from lorapool.worker.worker import Worker


def base_model_info(model: str) -> dict[str, str]:
    """The model directory's ``ModelIdentity`` (``lorapool.identity.model_identity``)."""
    return model_identity(model)


def serve(engine_args, config: WorkerConfig, connection: redis.Redis) -> Worker:
    """Build the engine of ``engine_args`` and serve the queue until stopped."""
    from lorapool.engine.llm_engine import LLMEngine

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    base_model = base_model_info(engine_args.model)
    keys = Keys(config.prefix, config.shards)  # the worker's loop's (``WorkerState.keys``)
    who = f"worker {config.name}"  # Redis away or at maxmemory: wait, saying why
    # before loading anything, on the same key (or ModelMismatchError)
    until_redis_takes(lambda: claim_model(connection, keys, base_model), who, "claim the pool")
    engine = LLMEngine.from_engine_args(engine_args)
    # jobs straight from Redis meet the gateway's checks here: a grammar that would crash
    # or run away costs a sandbox process and fails its job alone; a new grammar compiles
    # off the step's thread while its request waits (``engine.grammar_wait``)
    engine.guides.sandbox = GrammarSandbox(config.grammar_limits, 1)
    engine.guides.sandbox.warm()
    engine.guides.warm()
    until_redis_takes(
        lambda: publish_tokenizer(connection, keys, engine, base_model),
        who,
        "publish the tokenizer",
    )
    worker = Worker(engine, connection, config, base_model)
    saved = heap.quiet()  # the model and the engine frozen out of collections
    try:
        worker.run()
    finally:
        heap.restore(saved)
        engine.guides.close()
    return worker
