"""The client side of the queue: sync and asyncio producers and job handles (torch-free).

May import: redis, orjson and ``lorapool``'s torch-free modules; never torch or SQLAlchemy
(checked by ``tests/unit/test_import_rules.py``).
"""

from lorapool.lifecycle.marker import JobLost
from lorapool.producer.aio import AsyncJobHandle, AsyncProducer
from lorapool.producer.client import JobHandle, Producer
from lorapool.producer.registry import AdapterRegistry, describe_adapter

__all__ = [
    "AdapterRegistry",
    "AsyncJobHandle",
    "AsyncProducer",
    "JobHandle",
    "JobLost",
    "Producer",
    "describe_adapter",
]
