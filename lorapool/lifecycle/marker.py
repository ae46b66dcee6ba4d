"""What clients do to one request after submitting it: ask for its abort, and read
back its output (the chunk log while it streams, the final record once compacted).

Each function takes the connection or a pipeline (sync or redis.asyncio) and returns
what the client returns: awaitable on an asyncio client.
"""

from __future__ import annotations

from lorapool.lifecycle.chunk_log import RESULT_FIELD
from lorapool.lifecycle.keys import Keys

ABORT_TTL_S = 24 * 3600  # an abort flag outlives any request it can stop


def abort(connection, keys: Keys, request_id: str):
    """Ask whichever worker holds the request to stop it (finish_reason 'abort'):
    its abort flag, read with each lease renewal."""
    return connection.set(keys.abort(request_id), 1, ex=ABORT_TTL_S)


def read_back(pipe, keys: Keys, request_id: str, after: int, count: int | None = None) -> None:
    """Queue on ``pipe`` the reads that place a reader in the request's output, for one
    round trip: the log's chunks after seq ``after`` (at most ``count``), whether the
    log is still there, and the final record. ``read_back_result`` reads the replies."""
    end = -1 if count is None else after + count
    pipe.lrange(keys.out(request_id), after + 1, end)
    pipe.exists(keys.out(request_id))
    pipe.hget(keys.job(request_id), RESULT_FIELD)


def read_back_result(replies: list) -> tuple[list, bytes | None]:
    """The log's entries read, and the final record only once the log is gone
    (compacted; until then the log holds the whole output)."""
    entries, exists, result = replies[-3:]
    return entries, None if exists else result
