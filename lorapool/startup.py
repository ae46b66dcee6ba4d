"""A process's first Redis calls wait for Redis instead of failing the start.

A worker or an audit writer started while Redis is away (restarting, a network
blip) or refusing writes (``maxmemory`` reached under ``noeviction``) used to exit
with a traceback on its first write; one already running rides both out in its
loop (``Worker.run_guarded``, the audit writer's ``_retry``). ``until_redis_takes``
gives the start the same patience: it calls again with backoff, saying in one
line why it waits (then every tenth try), until Redis takes the call; any other
error is raised as before. SIGTERM during the wait ends the process as it would
before start-up (nothing is held yet).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

import redis

from lorapool.connection import REDIS_DOWN, out_of_memory

logger = logging.getLogger(__name__)
T = TypeVar("T")
WAITS_S = (0.5, 10.0)  # the first and the longest wait between tries
LOG_EVERY = 10  # tries between two log lines of one wait, after the first


def why_waiting(exc: BaseException) -> str | None:
    """Why a call that raised ``exc`` should be tried again later, or None if not."""
    if isinstance(exc, REDIS_DOWN):
        return "is unreachable"
    if out_of_memory(exc):
        return "is out of memory (maxmemory reached; make room or raise maxmemory)"
    return None


def until_redis_takes(
    call: Callable[[], T], who: str, what: str, sleep: Callable[[float], None] = time.sleep
) -> T:
    """``call()``'s result once Redis takes it; waits while Redis is away or full."""
    delay, tries, since = WAITS_S[0], 0, time.monotonic()
    while True:
        try:
            result = call()
        except (*REDIS_DOWN, redis.ResponseError) as exc:
            reason = why_waiting(exc)
            if reason is None:
                raise
            tries += 1
            if tries == 1 or tries % LOG_EVERY == 0:
                logger.warning(
                    "%s: cannot %s: Redis %s; try %d, next in %.1fs: %s",
                    who,
                    what,
                    reason,
                    tries,
                    delay,
                    str(exc).splitlines()[0] if str(exc) else type(exc).__name__,
                )
            sleep(delay)
            delay = min(delay * 2, WAITS_S[1])
            continue
        if tries:
            waited = time.monotonic() - since
            logger.warning("%s: could %s after %d tries (%.1fs)", who, what, tries, waited)
        return result
