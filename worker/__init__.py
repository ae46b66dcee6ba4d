"""The queue worker: drives one engine from the ``workers`` consumer group.

May import: the engine, redis, orjson, ``lorapool.records.audit`` (to build audit records)
and the lifecycle (an adapter's registry record: ``records.adapter``); never
the producer, SQLAlchemy sessions or the CLI.
"""

from lorapool.worker.config import WorkerConfig
from lorapool.worker.pool import ModelMismatchError
from lorapool.worker.worker import Worker

__all__ = ["ModelMismatchError", "Worker", "WorkerConfig"]
