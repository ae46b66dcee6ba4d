"""The client side of the queue: sync and asyncio producers and job handles (torch-free).
The client SDK, and nothing of the gateway: a web app imports it to submit jobs.

Which room a change belongs in: how a client submits, streams or waits is here (and the
adapter registry's and API keys' admin, which the CLI drives); what the gateway serves
over HTTP is ``gateway``; a record's fields are ``lorapool.records``; a Lua script or
key is ``lorapool.lifecycle``.

May import: redis, orjson and ``lorapool``'s torch-free modules (records, lifecycle);
never torch or SQLAlchemy (``tests/unit/test_import_rules.py``), never ``openai`` or
``gateway`` (``tests/unit/test_architecture.py``).
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
