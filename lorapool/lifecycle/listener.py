"""One request's live channel on a synchronous client: what a single ``JobHandle`` waits
on between its reads of the chunk log (``Follower`` is the asyncio counterpart that
follows many requests on one connection).

The worker publishes each chunk on the request's channel (named as its log) in the same
atomic call that appends it to the log. A reader subscribes, then reads the log from
where it stands: every chunk appended after that read arrives here. One lost on the way
(a broken connection) shows as a gap in the seqs or as a quiet spell, and the reader
reads the log again. On a Redis Cluster the channel is a shard channel (SSUBSCRIBE, as
the worker's SPUBLISH). Torch-free.
"""

from __future__ import annotations

import contextlib
import logging
import time

from lorapool.connection import REDIS_TRANSIENT

logger = logging.getLogger(__name__)
CONFIRM_S = 1.0  # the longest wait for the subscription's confirmation
_MESSAGES = ("message", "smessage")


class Listener:
    """``Listener(connection, channel)``: subscribed (confirmed, unless Redis is away)
    once built; ``next(timeout)`` gives the next payload published, ``close()`` frees
    the connection. Redis away reads as nothing published (the reader's log reads
    cover it), and the subscription is made again when it is back."""

    def __init__(self, connection, channel: str):
        import redis

        self.sharded = isinstance(connection, redis.RedisCluster)
        self.channel = channel
        self.pubsub = connection.pubsub()
        self.subscribed = False
        self._subscribe(CONFIRM_S)

    def next(self, timeout: float) -> bytes | None:
        """The next payload published on the channel, or None after ``timeout`` seconds
        (sooner when the connection broke)."""
        deadline = time.monotonic() + timeout
        try:
            if not self.subscribed and not self._subscribe(timeout):
                return None
            while (left := deadline - time.monotonic()) > 0:
                message = self._message(left)
                if message is None:
                    return None
                if _kind(message) in _MESSAGES:
                    return message["data"]
        except REDIS_TRANSIENT as exc:
            logger.warning("%s: Pub/Sub connection lost (%s), reading the log", self.channel, exc)
            self.subscribed = False
            time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
        return None

    def close(self) -> None:
        with contextlib.suppress(*REDIS_TRANSIENT):
            self.pubsub.close()

    def _subscribe(self, confirm_s: float) -> bool:
        """Subscribes and waits up to ``confirm_s`` for the confirmation (a message
        published before it would not reach this connection)."""
        try:
            if self.sharded:
                self.pubsub.ssubscribe(self.channel)
            else:
                self.pubsub.subscribe(self.channel)
            deadline = time.monotonic() + confirm_s
            while (left := deadline - time.monotonic()) > 0:
                message = self._message(left)
                if message is not None and _kind(message) in ("subscribe", "ssubscribe"):
                    self.subscribed = True
                    break
        except REDIS_TRANSIENT as exc:
            logger.warning("%s: cannot subscribe (%s), reading the log", self.channel, exc)
        return self.subscribed

    def _message(self, timeout: float) -> dict | None:
        if self.sharded:
            return self.pubsub.get_sharded_message(timeout=timeout)
        return self.pubsub.get_message(timeout=timeout)


def _kind(message: dict) -> str:
    kind = message["type"]
    return kind.decode() if isinstance(kind, bytes) else kind
