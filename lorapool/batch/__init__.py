"""Batch files over the pool (OpenAI's Batch API): files, batch state, and the RQ jobs
that validate a file, submit its lines as ordinary pool jobs and collect their outputs.

Torch-free; the lines are checked by the gateway's own request parser, so this package
needs the ``gateway`` extra's FastAPI installed, and RQ.
"""

from lorapool.batch.files import FileStore
from lorapool.batch.service import BatchError, BatchService
from lorapool.batch.state import Status
from lorapool.batch.tasks import BatchConfig

__all__ = ["BatchConfig", "BatchError", "BatchService", "FileStore", "Status"]
