"""The synchronous producer: submit jobs, stream and await their outputs."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from typing import Any

import redis

from lorapool import connection
from lorapool.lifecycle import marker, orphaned, unread
from lorapool.lifecycle.chunk_log import Cursor, OutputAssembler
from lorapool.lifecycle.keys import DEFAULT_PREFIX, Keys
from lorapool.lifecycle.listener import Listener
from lorapool.lifecycle.submit import Submit, build_job, check_on_finish
from lorapool.outputs import RequestOutput
from lorapool.producer.job import distinct, per_prompt
from lorapool.producer.registry import AdapterRegistry
from lorapool.protocol import LoRARequest, RequestOutputKind, SamplingParams
from lorapool.records.adapter import AdapterRecord
from lorapool.records.chunk import decode_chunk
from lorapool.records.job import DEFAULT_MAX_N, DEFAULT_MAX_PROMPT_BYTES, JobLimits
from lorapool.records.marker import job_status

logger = logging.getLogger(__name__)
_WAIT_S = 1.0  # quiet this long, a handle reads the log again
_PAGE = 256  # chunks per read of the log


def connect(
    url_or_connection: str | redis.Redis | None, retries: int = connection.RETRIES
) -> redis.Redis:
    """A client for a URL, an existing client, or (None) ``$REDIS_URL`` / embedded Redis.

    A URL gets lorapool's retry and health-check options (``lorapool.connection``).
    """
    if isinstance(url_or_connection, (redis.Redis, redis.RedisCluster)):
        return url_or_connection
    if url_or_connection is None:
        from lorapool.embedded import resolve_url

        url_or_connection = resolve_url()
    return connection.connect(url_or_connection, retries)


class JobHandle:
    """One submitted request: stream its outputs, wait for the result, abort it."""

    def __init__(
        self,
        producer: Producer,
        request_id: str,
        output_kind: RequestOutputKind | str = RequestOutputKind.CUMULATIVE,
        enqueued: bool = True,
    ):
        self.producer = producer
        self.request_id = request_id
        self.output_kind = RequestOutputKind(output_kind)
        self.enqueued = enqueued  # False: the id existed and nothing new was queued

    def chunks(self, after: int = -1, timeout: float | None = None) -> Iterator[Any]:
        """The request's chunks with seq > ``after``, in order, until the final one.

        Reads the chunk log (the source of truth) from where it stands; while the request
        runs, it follows the request's live channel (``Listener``, subscribed before the
        log is read again), and goes back to the log after a gap in the seqs or a quiet
        second, so a late reader misses nothing. Once the log is compacted, the rest
        comes from the final record as one chunk (``LogCompacted`` if the reader started
        midway and so cannot tell where the rest begins). TimeoutError after
        ``timeout`` seconds.
        """
        cursor, deadline = Cursor(self.request_id, after), _deadline(timeout)
        self._quiet = orphaned.Quiet()
        yield from self._read_log(cursor)
        if cursor.done:  # finished already: no subscription
            return
        listener = Listener(self.producer.redis, self.producer.keys.out(self.request_id))
        try:
            while not cursor.done:
                yield from self._read_log(cursor, quiet=True)
                while not cursor.done:
                    if deadline is not None and time.monotonic() >= deadline:
                        raise TimeoutError(
                            f"request {self.request_id}: no final output in {timeout}s"
                        )
                    payload = listener.next(_wait_s(deadline))
                    if payload is None:
                        break  # quiet, or the connection broke: read the log
                    chunk = decode_chunk(payload, self.request_id)
                    if cursor.accepts(chunk):
                        yield cursor.give(chunk)
                    elif chunk.seq > cursor.seq:
                        break  # past a gap: read the log
        finally:
            listener.close()

    def _read_log(self, cursor: Cursor, quiet: bool = False) -> Iterator[Any]:
        """What the log holds past ``cursor`` (page by page), or the rest of the final
        record once there is one and the log has nothing to follow on with (compacted,
        or made again without its head); nothing while Redis is away. ``quiet``
        (a read after a quiet while) with nothing read yet: first ends the request if
        its queue entry was removed unread (``lifecycle.unread``); with a log, once no
        chunk came for a while, if its worker stopped partway and its entry is gone
        (``lifecycle.orphaned``)."""
        keys, rid = self.producer.keys, self.request_id
        if quiet and cursor.seq < 0 and not cursor.logged:
            try:
                ended = self.producer._end_unread(rid)
                if ended:
                    unread.log_ended(rid, ended)
            except connection.REDIS_TRANSIENT:
                pass  # the log read below waits for Redis
            except redis.ResponseError as exc:  # an ACL refusal: it wrote nothing
                unread.log_refused(rid, exc)
        elif quiet and self._quiet.due(cursor.seq):
            self._end_orphaned(cursor)
        while not cursor.done:
            try:
                with self.producer.redis.pipeline(transaction=False) as pipe:
                    marker.read_back(pipe, keys, rid, cursor.seq, count=_PAGE)
                    replies = pipe.execute(raise_on_error=False)
                    entries, result = marker.read_back_result(replies, rid)
            except connection.REDIS_TRANSIENT as exc:
                logger.warning("request %s: Redis unreachable (%s), waiting", rid, exc)
                time.sleep(_WAIT_S)
                return
            before = cursor.seq
            yield from cursor.take(entries)
            if cursor.seq != before:
                if len(entries) == _PAGE and not cursor.done:
                    continue
            elif result is not None:  # compacted, or a log made again without its head
                yield from cursor.rest(result)
            return

    def _end_orphaned(self, cursor: Cursor) -> None:
        """End the request if its worker stopped partway and its entry is gone
        (``lifecycle.orphaned``); the log read that follows gives the final chunk."""
        producer, rid = self.producer, self.request_id
        try:
            ended = orphaned.end(producer._end_unread, rid)
            if ended:
                orphaned.log_ended(rid, ended)
        except connection.REDIS_TRANSIENT:
            pass  # the log read waits for Redis
        except redis.ResponseError as exc:  # an ACL refusal: it wrote nothing
            unread.log_refused(rid, exc)

    def stream(self, after: int = -1, timeout: float | None = None) -> Iterator[RequestOutput]:
        """RequestOutputs in the job's ``output_kind``; ``after``: skip chunks up to that seq.

        Started midway (``after`` = the last seq already seen), a cumulative
        stream still carries everything from the beginning.
        """
        assembler = OutputAssembler(self.output_kind)
        for chunk in self.chunks(timeout=timeout):
            output = assembler.feed(chunk)
            if output is not None and chunk.seq > after:
                yield output

    def result(self, timeout: float | None = None) -> RequestOutput:
        """The final, cumulative RequestOutput (TimeoutError after ``timeout`` seconds)."""
        assembler = OutputAssembler(RequestOutputKind.FINAL_ONLY)
        for chunk in self.chunks(timeout=timeout):
            output = assembler.feed(chunk)
            if output is not None:
                return output
        raise RuntimeError(f"request {self.request_id}: chunk log ended without a final chunk")

    def abort(self) -> None:
        """Ask whichever worker holds the request to stop it (finish_reason 'abort')."""
        self.producer.abort(self.request_id)

    def status(self) -> str | None:
        """queued, finished or failed (``JobStatus``); None for an unknown id. Ended
        only by what a worker wrote (the run key), never by the marker's fields."""
        keys, rid = self.producer.keys, self.request_id
        with self.producer.redis.pipeline(transaction=False) as pipe:
            pipe.hget(keys.run(rid), "status")
            pipe.exists(keys.job(rid))
            ran, submitted = pipe.execute()
        return job_status(ran, submitted)


class Producer:
    """Enqueues jobs on ``{p}:requests``; ``connection`` is a URL or a redis client."""

    def __init__(
        self,
        connection: str | redis.Redis | None = None,
        prefix: str = DEFAULT_PREFIX,
        max_prompt_bytes: int = DEFAULT_MAX_PROMPT_BYTES,
        max_n: int = DEFAULT_MAX_N,
        result_ttl_s: int | None = None,
        shards: int = 0,
    ):
        """Jobs over ``max_prompt_bytes`` or ``max_n`` are refused at submit (workers check too).

        ``result_ttl_s``: how long a finished job's outputs stay readable (as
        RQ's ``result_ttl``); None leaves it to the workers' ``--result-ttl``.
        ``shards``: the pool's shard count on a Redis Cluster (``lifecycle.keys``), the
        same as its workers'; 0 (default) for one standalone Redis.
        """
        self.limits = JobLimits(max_prompt_bytes, max_n)
        self.result_ttl_s = result_ttl_s
        self.redis = connect(connection)
        self.keys = Keys(prefix, shards)
        self.registry = AdapterRegistry(self.redis, self.keys)
        self._submit = Submit(self.redis, self.keys)
        self._end_unread = unread.EndUnread(self.redis, self.keys)

    def submit(
        self,
        prompt: str | dict[str, Any],
        params: SamplingParams | None = None,
        lora_request: LoRARequest | str | None = None,
        request_id: str | None = None,
        metadata: dict[str, Any] | None = None,
        priority: str = "interactive",
        on_finish: str | None = None,
    ) -> JobHandle:
        """Enqueue one job; a request id that exists returns its handle, enqueuing nothing.

        ``priority``: "interactive", or "batch" for work that may wait: workers take
        batch jobs only with capacity left after the interactive ones.
        ``on_finish``: a completion callback, the dotted path of a function run as an
        RQ job, or an http(s) URL POSTed to, once the request's final record is stored.

        Raises ValueError naming the problem (sampling params, prompt, unknown
        adapter, colliding adapter id, priority).
        """
        handles = self.submit_many(
            [prompt], params, [lora_request], [request_id], metadata, priority, on_finish
        )
        return handles[0]

    def submit_many(
        self,
        prompts: Sequence[str | dict[str, Any]],
        params: SamplingParams | list[SamplingParams] | None = None,
        lora_request: LoRARequest | AdapterRecord | str | None | list = None,
        request_ids: list[str | None] | None = None,
        metadata: dict[str, Any] | None = None,
        priority: str = "interactive",
        on_finish: str | None = None,
    ) -> list[JobHandle]:
        """Enqueue several jobs in one round trip; all are validated before any is sent."""
        self.keys.on(0).stream(priority)  # an unknown priority fails before anything is sent
        callback = check_on_finish(on_finish)
        count = len(prompts)
        unique, at = distinct(per_prompt(lora_request, count, "adapters"))
        resolved = [self.registry.resolve(x) for x in unique]
        loras = [resolved[i] for i in at]
        jobs = [
            build_job(p, sp, lora, rid, metadata, self.limits, self.result_ttl_s)
            for p, sp, lora, rid in zip(
                prompts, per_prompt(params, count, "params"), loras, request_ids or [None] * count
            )
        ]
        entries = self._submit(jobs, priority, callback)
        return [self._handle_after_submit(job, entry) for job, entry in zip(jobs, entries)]

    def _handle_after_submit(self, job, entry) -> JobHandle:
        if entry:
            return JobHandle(self, job.request_id, job.sampling_params.output_kind)
        handle = self.handle(job.request_id)
        handle.enqueued = False
        return handle

    def handle(self, request_id: str) -> JobHandle:
        """The handle of an existing request (its output kind read from the job marker)."""
        kind = self.redis.hget(self.keys.job(request_id), "output_kind")
        return JobHandle(self, request_id, kind.decode() if kind else "cumulative")

    def abort(self, request_id: str) -> None:
        marker.abort(self.redis, self.keys, request_id)


def _deadline(timeout: float | None) -> float | None:
    return None if timeout is None else time.monotonic() + timeout


def _wait_s(deadline: float | None) -> float:
    """How long to wait on the live channel before reading the log again."""
    if deadline is None:
        return _WAIT_S
    return max(0.001, min(_WAIT_S, deadline - time.monotonic()))
