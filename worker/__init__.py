"""The queue worker: drives one engine from the ``workers`` consumer group."""

from lorapool.worker.config import WorkerConfig
from lorapool.worker.worker import Worker

__all__ = ["Worker", "WorkerConfig"]
