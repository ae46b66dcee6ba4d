"""The HTTP gateway (``lorapool serve``): OpenAI-compatible and asynchronous-job APIs
over the queue. Torch-free and stateless: it submits through ``lorapool.producer``
and reads chunk logs through its handles, so any number of copies serve one pool.

May import: fastapi, starlette (and anyio, which runs its responses), redis, orjson and
lorapool's torch-free modules.
"""

from lorapool.gateway.app import create_app
from lorapool.gateway.config import GatewayConfig

__all__ = ["GatewayConfig", "create_app"]
