"""Batch files over the pool (OpenAI's Batch API): files, batch state, and the RQ jobs
that validate a file, submit its lines as ordinary pool jobs and collect their outputs;
and completion callbacks (``lorapool.batch.callbacks``).

May import redis, rq, orjson, the lifecycle and ``lorapool.openai`` (a batch line is
parsed and answered as the gateway's requests are); never the gateway (nor FastAPI),
torch or SQLAlchemy. Names are imported
on first use, so the audit writer can load the callbacks alone.
"""

from importlib import import_module

_NAMES = {
    "FileStore": "lorapool.batch.files",
    "BatchError": "lorapool.batch.service",
    "BatchService": "lorapool.batch.service",
    "Status": "lorapool.batch.state",
    "BatchConfig": "lorapool.batch.tasks",
}
__all__ = sorted(_NAMES)


def __getattr__(name: str):
    if name not in _NAMES:
        raise AttributeError(f"module 'lorapool.batch' has no attribute {name!r}")
    return getattr(import_module(_NAMES[name]), name)
