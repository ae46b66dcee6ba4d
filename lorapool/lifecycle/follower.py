"""One connection that follows many requests' outputs (asyncio): the live channel for
speed, the chunk log for exactness.

The worker appends each chunk to the request's log and publishes the same bytes on its
channel in one atomic call. A follower subscribes to the channels of the requests it
follows on one Pub/Sub connection; when it starts following a request (once the
subscription is confirmed) and whenever a chunk arrives past a gap, it reads the
missing chunks from the log, so every reader gets every chunk once, in order, even
if Pub/Sub dropped some (a reconnect, a slow consumer). A request that stays quiet for
``poll_s`` has its log polled (then at doubling intervals up to ``MAX_QUIET_S`` while it
waits in the queue), which also finds a lost final chunk or a compacted log's record.

Used by ``AsyncProducer`` (and so by the gateway); a single ``JobHandle`` does the same
on a connection of its own (``Listener``). On a Redis Cluster the channels are shard channels (the
worker's SPUBLISH, the follower's SSUBSCRIBE: one Pub/Sub connection per node that
holds a followed request's shard), so a chunk travels only within its shard.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import redis

from lorapool.connection import REDIS_TRANSIENT as TRANSIENT
from lorapool.lifecycle import orphaned, unread
from lorapool.lifecycle.chunk_log import Cursor
from lorapool.lifecycle.keys import Keys
from lorapool.lifecycle.marker import read_back, read_back_result
from lorapool.records.chunk import Chunk, decode_chunk
from lorapool.tasks import cancel_and_wait

logger = logging.getLogger(__name__)
MAX_FILLS = 8  # log reads in flight at once (each holds a pooled connection)
MAX_QUIET_S = 8.0  # a request quiet this long has its log polled no more often
LISTEN_S = 0.005  # the listener's longest read: a new subscription waits at most this
# (none when nothing is followed: the listener waits for the first one's wake, ``_idle``)
# a subscription's confirmation is awaited in slices of this; a slice counts at most this
# long however long the process stood still in it (a full GC of a big heap: ~1 s measured)
CONFIRM_SLICE_S = 0.1


class _Followed:
    """One request being followed: its cursor, what arrived live, and the subscribe
    confirmation."""

    def __init__(self, request_id: str, after: int):
        self.cursor = Cursor(request_id, after)
        self.live: asyncio.Queue[bytes] = asyncio.Queue()
        self.subscribed = asyncio.Event()


class Follower:
    """Follows any number of requests of one pool on one Pub/Sub connection."""

    def __init__(self, redis, keys: Keys, poll_s: float = 1.0):
        self.redis, self.keys, self.poll_s = redis, keys, poll_s
        self.followed: dict[bytes, list[_Followed]] = {}  # channel -> its readers
        self.pubsub = None
        self.task: asyncio.Task | None = None
        self.num_live = self.num_filled = 0  # chunks given from the channel / the log
        # (un)subscribes wait here for the listener: only its task touches the Pub/Sub
        # connection (redis-py's reads must not overlap a command's health check)
        self.to_subscribe: set[bytes] = set()
        self.to_unsubscribe: set[bytes] = set()
        self.wake = asyncio.Event()  # set with each (un)subscribe asked for
        self.fills = asyncio.Semaphore(MAX_FILLS)
        self.unread = unread.EndUnread(redis, keys)
        self.error: Exception | None = None  # why the listener stopped (not Redis away)
        self.closed = False
        self.turn = 0  # the node the listener waits on next (a cluster)
        from redis.asyncio import RedisCluster

        self.sharded = isinstance(redis, RedisCluster)  # shard channels (SSUBSCRIBE)

    async def follow(self, request_id: str, after: int = -1) -> AsyncIterator[Chunk]:
        """Chunks of ``request_id`` with seq > ``after``, in order, until the final one."""
        channel = self.keys.out(request_id).encode()
        followed = _Followed(request_id, after)
        readers = self.followed.setdefault(channel, [])
        readers.append(followed)
        try:
            if len(readers) == 1:
                await self._subscribe(channel, followed)
            async for chunk in self._chunks(followed):
                yield chunk
        finally:
            readers.remove(followed)
            if not readers:
                del self.followed[channel]
                self.to_subscribe.discard(channel)
                self.to_unsubscribe.add(channel)
                self.wake.set()

    async def close(self) -> None:
        # the flag as well as the cancel: on Python 3.11 redis-py's writes (asyncio.wait_for
        # around drain) can swallow a cancel that lands as the write completes (tasks.py)
        self.closed = True
        if self.task is not None:
            await cancel_and_wait(self.task)
        if self.pubsub is not None:
            await self.pubsub.aclose()

    async def _subscribe(self, channel: bytes, followed: _Followed) -> None:
        if self.pubsub is None:
            self.pubsub = self.redis.pubsub()
        self.to_unsubscribe.discard(channel)
        self.to_subscribe.add(channel)
        self.wake.set()
        if self.task is None or self.task.done():
            self.task = asyncio.get_running_loop().create_task(self._listen())
        if not await self._confirmed(followed):  # a broken connection: the log polls cover it
            logger.warning("follower: no subscribe confirmation for %s", channel.decode())
        if self.error is not None:
            raise self.error

    async def _confirmed(self, followed: _Followed) -> bool:
        """Whether the subscription was confirmed within ``poll_s`` of the listener's
        chances to read it: waited in slices, each counted as ``CONFIRM_SLICE_S`` though
        the process stood still through it (a second of full GC in a big process ran
        the whole wait out before the listener's read of the reply, already there)."""
        for _ in range(max(1, round(self.poll_s / CONFIRM_SLICE_S))):
            try:
                await asyncio.wait_for(followed.subscribed.wait(), CONFIRM_SLICE_S)
                return True
            except asyncio.TimeoutError:
                continue
        return False

    async def _chunks(self, followed: _Followed) -> AsyncIterator[Chunk]:
        cursor, quiet, still = followed.cursor, self.poll_s, orphaned.Quiet()
        for chunk in await self._fill(cursor):  # what came before the subscription
            yield chunk
        while not cursor.done:
            payload = await _next(followed.live, quiet)
            if self.error is not None:
                raise self.error
            if payload is not None:
                chunk, quiet = decode_chunk(payload, cursor.request_id), self.poll_s
                if cursor.accepts(chunk):
                    self.num_live += 1
                    yield cursor.give(chunk)
                    continue
                if chunk.seq <= cursor.seq:
                    continue  # given already, from the log
            filled = await self._fill(cursor)  # a gap, or quiet for a while
            for chunk in filled:
                yield chunk
            if payload is None and not filled:  # still queued: poll less and less often
                quiet = min(MAX_QUIET_S, 2 * quiet)
                if cursor.seq < 0 and not cursor.logged:
                    ended = await self._end_unread(cursor.request_id)
                else:
                    ended = still.due(cursor.seq) and await self._end_orphaned(cursor)
                if ended:  # asked the workers: their final record comes within a second
                    quiet = self.poll_s

    async def _end_unread(self, request_id: str) -> bool:
        """Whether this call ended ``request_id`` because its queue entry was removed
        before any worker read it (``lifecycle.unread``); False while Redis is away."""
        return await self._ended(request_id, lambda: self.unread(request_id), unread.log_ended)

    async def _end_orphaned(self, cursor: Cursor) -> bool:
        """Whether this call ended the request because its worker stopped partway and
        its entry is gone (``lifecycle.orphaned``); False while Redis is away."""
        rid = cursor.request_id
        return await self._ended(
            rid,
            lambda: orphaned.end_async(self.unread, rid),
            orphaned.log_ended,
        )

    async def _ended(self, request_id: str, ending, log_ended) -> bool:
        """Awaits ``ending()`` (an END_UNREAD call) among the fills; whether it ended the
        request (logged by ``log_ended``). False while Redis is away, and on an ACL
        refusal, which wrote nothing."""
        try:
            async with self.fills:
                ended = await ending()
        except TRANSIENT:
            return False
        except redis.ResponseError as exc:
            unread.log_refused(request_id, exc)
            return False
        if ended:
            log_ended(request_id, ended)
        return bool(ended)

    async def _fill(self, cursor: Cursor) -> list[Chunk]:
        """The chunks past ``cursor`` in the log, or the rest of the final record once
        there is one and the log has nothing to follow on with (compacted, or made
        again without its head); none while Redis is away."""
        try:
            async with self.fills, self.redis.pipeline(transaction=False) as pipe:
                read_back(pipe, self.keys, cursor.request_id, cursor.seq)
                replies = await pipe.execute(raise_on_error=False)
                entries, result = read_back_result(replies, cursor.request_id)
        except TRANSIENT as exc:
            logger.warning("follower: Redis unreachable (%s), waiting", exc)
            return []
        chunks = list(cursor.take(entries))
        if not chunks and result is not None:  # compacted, or a log made without its head
            chunks = list(cursor.rest(result))
        self.num_filled += len(chunks)
        return chunks

    async def _listen(self) -> None:
        """Hands each live chunk to the request it belongs to, and sends the
        (un)subscribes asked for between reads; resubscribes everything after a broken
        connection (the requests' log polls fill what was missed). Any other error
        (say, a Redis user without SUBSCRIBE) goes to every reader."""
        try:
            await self._relay()
        except (redis.RedisError, redis.exceptions.RedisClusterException) as exc:
            logger.error("follower: stopped: %s", exc)
            self.error = exc
            for readers in self.followed.values():
                for followed in readers:
                    followed.subscribed.set()
                    followed.live.put_nowait(b"")

    async def _relay(self) -> None:
        while not self.closed:
            try:
                self.wake.clear()
                await self._send_subscriptions()
                if self._idle():  # nothing followed: no read, no busy loop
                    await self.wake.wait()  # the next subscription goes out at once
                    continue
                if self.sharded:
                    message = await self._sharded_message()
                else:
                    message = await self.pubsub.get_message(timeout=LISTEN_S)
            except TRANSIENT as exc:
                logger.warning("follower: Pub/Sub connection lost (%s), resubscribing", exc)
                await asyncio.sleep(self.poll_s)
                self.to_subscribe |= set(self.followed)
                continue
            if message is None:
                continue
            kind = message["type"]
            kind = kind.decode() if isinstance(kind, bytes) else kind
            for followed in self.followed.get(message["channel"], ()):
                if kind in ("subscribe", "ssubscribe"):
                    followed.subscribed.set()
                elif kind in ("message", "smessage"):
                    followed.live.put_nowait(message["data"])

    def _idle(self) -> bool:
        """Nothing subscribed, no confirmation to read, nothing asked for. (It waited
        for its read's timeout and then slept as long again: a light tenant's call, one
        every 0.1 s, waited 30 ms of its 45 for its subscription to go out.)"""
        if self.to_subscribe or self.to_unsubscribe:
            return False
        if self.sharded:  # a node's connection exists while it has a channel
            return not self.pubsub.node_pubsub_mapping
        return not self.pubsub.subscribed

    async def _sharded_message(self) -> dict | None:
        """The next message of any node's connection: first any one already read, then
        a wait of ``LISTEN_S`` on one node (the nodes in turn; a message on another is
        read at the next round, within ``LISTEN_S``). (redis-py's own round robin waits
        its timeout on each idle node in turn: with one busy node of three, one message
        per two timeouts, and the readers fell back to their logs. A wait of LISTEN_S /
        nodes polled as many times more often: following 50 quiet requests on three
        nodes took 6.8-7.3% of a core against 3.8-5.0%, bench follower_idle.)"""
        nodes = [self.redis.get_node(node_name=name) for name in self.pubsub.node_pubsub_mapping]
        nodes = [node for node in nodes if node is not None]
        if not nodes:
            return None
        self.turn = (self.turn + 1) % len(nodes)
        nodes = nodes[self.turn :] + nodes[: self.turn]
        for node in nodes:
            message = await self.pubsub.get_sharded_message(timeout=0, target_node=node)
            if message is not None:
                return message
        return await self.pubsub.get_sharded_message(timeout=LISTEN_S, target_node=nodes[0])

    async def _send_subscriptions(self) -> None:
        if self.to_unsubscribe:
            channels, self.to_unsubscribe = self.to_unsubscribe, set()
            if self.sharded:
                await self.pubsub.sunsubscribe(*channels)
            else:
                await self.pubsub.unsubscribe(*channels)
        if self.to_subscribe:
            channels, self.to_subscribe = self.to_subscribe, set()
            try:
                if self.sharded:
                    await self.redis.initialize()  # ssubscribe routes by the known slots
                    await self.pubsub.ssubscribe(*channels)
                else:
                    await self.pubsub.subscribe(*channels)
            except BaseException:
                self.to_subscribe |= channels & set(self.followed)
                raise


async def _next(live: asyncio.Queue, timeout: float) -> bytes | None:
    """The next live payload, or None after ``timeout`` (no timer when one is waiting:
    a burst of a step's chunks costs no task per chunk)."""
    if not live.empty():
        return live.get_nowait()
    try:
        return await asyncio.wait_for(live.get(), timeout)
    except asyncio.TimeoutError:
        return None
