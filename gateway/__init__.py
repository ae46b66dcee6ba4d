"""The HTTP gateway (``lorapool serve``): OpenAI-compatible and asynchronous-job APIs
over the queue. Torch-free and stateless: it submits through ``lorapool.producer``
and reads chunk logs through its handles, so any number of copies serve one pool.
``pool_view`` is its view of the pool (workers, adapters, keys, a job's state), read from
Redis for its routes and dashboard.

Which room a change belongs in: an HTTP route, status code or a body's shape for one
endpoint is here; what a request body means (bounds, parsing, OpenAI's wording) is
``lorapool.openai``; a field of a record that crosses Redis is ``lorapool.records``.

May import: fastapi, starlette (and anyio, which runs its responses), redis, orjson and
lorapool's torch-free modules.
"""

from lorapool.gateway.app import create_app
from lorapool.gateway.config import GatewayConfig

__all__ = ["GatewayConfig", "create_app"]
