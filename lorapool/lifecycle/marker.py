"""What clients do to one request after submitting it: ask for its abort, and read
back its output (the chunk log while it streams, the final record once compacted);
what a reader may meet instead (``JobLost``, ``NoWorker``).

Each function takes the connection or a pipeline (sync or redis.asyncio) and returns
what the client returns: awaitable on an asyncio client.
"""

from __future__ import annotations

from lorapool.connection import register_script
from lorapool.lifecycle.keys import Keys
from lorapool.records.marker import RESULT_FIELD

ABORT_TTL_S = 24 * 3600  # an abort flag outlives any request it can stop
# an abort for an id with no marker (unknown, or finished and expired): kept only
# minutes, in case the submit is on its way (500 aborts of unknown ids left 500 keys
# for 24 h)
UNKNOWN_ABORT_TTL_S = 300

# KEYS: the job's marker, its abort flag. ARGV: the flag's TTL with a marker, without.
ABORT = """
local ttl = ARGV[2]
if redis.call('EXISTS', KEYS[1]) == 1 then ttl = ARGV[1] end
return redis.call('SET', KEYS[2], 1, 'EX', ttl)
"""


def abort(connection, keys: Keys, request_id: str):
    """Ask whichever worker holds the request to stop it (finish_reason 'abort'):
    its abort flag, read with each lease renewal; for a request id with no marker,
    a flag that expires in ``UNKNOWN_ABORT_TTL_S``."""
    script = register_script(connection, ABORT)
    return script(
        keys=[keys.job(request_id), keys.abort(request_id)],
        args=[ABORT_TTL_S, UNKNOWN_ABORT_TTL_S],
    )


class JobLost(RuntimeError):
    """A request whose job marker and chunk log are both gone from Redis: it will never
    finish (a Redis restarted without persistence, a FLUSHDB, an operator's DEL, or its
    result's TTL passed). Readers raise it at their next read of the log, within
    seconds, instead of waiting until their timeout."""

    def __init__(self, request_id: str):
        super().__init__(
            f"request {request_id}: its job marker and chunk log are gone from Redis (a "
            "Redis restart without persistence, FLUSHDB or DEL, or its result's TTL "
            "passed); it will not finish"
        )
        self.request_id = request_id


class NoWorker(RuntimeError):
    """Requests no worker had taken ``waited_s`` after their submit: they stay queued,
    for the worker a scale-up brings (their readers stop waiting, not the requests)."""

    def __init__(self, request_ids: list[str], waited_s: float):
        super().__init__(f"no worker took {', '.join(request_ids)} within {waited_s:g}s")
        self.request_ids, self.waited_s = request_ids, waited_s


class RedisAway(RuntimeError):
    """Redis has not answered for ``seconds`` in a row (None: it is away now), as the
    gateway's watch found (``gateway.redis_watch``): a wait for jobs ends with it, the
    jobs left as they are (Redis cannot be told). ``retry_after_s``: when to try again."""

    def __init__(self, seconds: float | None, retry_after_s: int):
        how_long = "" if seconds is None else f" for {seconds:g}s"
        super().__init__(f"the queue (Redis) has not answered{how_long}; retry later")
        self.seconds, self.retry_after_s = seconds, retry_after_s


def read_back(pipe, keys: Keys, request_id: str, after: int, count: int | None = None) -> None:
    """Queue on ``pipe`` the reads that place a reader in the request's output, for one
    round trip: the log's chunks after seq ``after`` (at most ``count``), whether the
    log is still there, the final record (the run key's: only workers write it,
    ``lifecycle.run_state``; never the marker's, which any producer may write) and
    whether the marker and the run key are there. ``read_back_result`` reads the
    replies."""
    end = -1 if count is None else after + count
    pipe.lrange(keys.out(request_id), after + 1, end)
    pipe.exists(keys.out(request_id))
    pipe.hget(keys.run(request_id), RESULT_FIELD)
    pipe.exists(keys.job(request_id), keys.run(request_id))


def read_back_result(replies: list, request_id: str = "") -> tuple[list, bytes | None]:
    """The log's entries read, and the final record once the request has one (None
    before). Readers take the log's chunks while they follow on from their cursor and
    the final record's rest when the log is gone (compacted) or holds nothing they can
    take: a log an operator deleted while its request ran is made again without its
    first chunks, which no reader would ever get. JobLost when the log, the marker and
    the run key are all gone. ``replies``: with ``raise_on_error=False``."""
    entries, exists, result, marker = replies[-4:]
    for reply in (entries, exists, marker):
        if isinstance(reply, Exception):
            raise reply
    if isinstance(result, Exception):  # a run key of another type (an operator's SET):
        result = None  # the workers leave it alone and keep the log for the result's TTL
    if not exists and not marker:
        raise JobLost(request_id)
    return entries, result
