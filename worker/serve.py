"""Start a worker from its configs: build the engine, identify the base model, run."""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import redis

from lorapool.worker.config import WorkerConfig
from lorapool.worker.worker import Worker


def base_model_info(model: str) -> dict[str, str]:
    """{"name", "sha256"}: the sha256 over the model's safetensors files, in name order."""
    path = Path(model)
    digest = hashlib.sha256()
    for weights in sorted(path.glob("*.safetensors")):
        with weights.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return {"name": path.name or str(path), "sha256": digest.hexdigest()}


def serve(engine_args, config: WorkerConfig, connection: redis.Redis) -> Worker:
    """Build the engine of ``engine_args`` and serve the queue until stopped."""
    from lorapool.engine.llm_engine import LLMEngine

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    engine = LLMEngine.from_engine_args(engine_args)
    worker = Worker(engine, connection, config, base_model_info(engine_args.model))
    worker.run()
    return worker
