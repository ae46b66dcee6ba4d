"""From engine outputs to chunk logs: positions on the worker's thread, the rest on the
sender's (``sender.py``), one APPEND call per round trip.

Coalescing: a step's chunks go out at once when the previous round trip is
done and the worker writes under ``max_chunk_rate`` chunks a second; when the
trip is not done, or a trip of n chunks went out less than n / max_chunk_rate
seconds ago (a busy pool: 256 sequences at 30 steps a second would write 7,680
a second), they wait and merge with the next steps' (one chunk per request),
and once ``MAX_BEHIND`` steps wait, they go (the engine waiting for Redis if
the trip before is still on its way). So a token reaches Redis at most
``MAX_BEHIND`` steps plus one round trip after its step, and a slow Redis slows
the engine instead of piling up chunks. A light pool's chunks go every step, and
a request's first chunk never waits for the rate (time to first token). The round
trip also reads new entries for the engine's free slots (registered at once with the
renewer, ``renewer.py``, which keeps the lease and the heartbeat on a thread of its
own), unless the worker's thread read them after the step (``Intake.between_steps``:
when that read costs little beside the step, so that they run in the next step), and
carries the upkeep calls handed to it (``extra``): while the engine runs, no Redis call
waits on the worker's thread.

The two threads share no state: the worker's thread hands a trip over
(``Sender.hand``) and takes it back (``Sender.take_done``, in ``_collect``):
- A trip's requests (their ``Held``: the chunks it keeps, ``fenced``) are the
  sender's from the hand-over until the trip is taken back; the worker's thread
  touches a ``Held``'s chunks only while no trip holds it (``flush(wait=True)``
  returns with none out: the dead-letter paths call it first).
- The worker's thread takes every finished trip back before it hands the next
  (``flush`` looks again once the sender is idle; ``Sender.hand`` refuses
  otherwise), so no trip's results are applied while a later trip is out.
- What a trip carries besides (chunk positions, the read plan, ``extra``) is built
  for it and not touched again by the worker's thread. The sender's thread reads, beside them, only
  what is fixed before it starts (the name, config, keys, base model) and the
  pool view of ``Intake``, which the worker's thread changes only with no trip out.
tests/integration/test_sender_handover.py checks this under stress.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from lorapool.lifecycle.append import (
    ANSWERED,
    ASK,
    BAD_LOG,
    BAD_MARKER,
    NAMED,
    NOT_OWNER,
    SKIP,
    VANISHED,
    Append,
    Appender,
)
from lorapool.lifecycle.chunk_log import encode_result
from lorapool.outputs import RequestOutput
from lorapool.records.chunk import Chunk, encode_chunk
from lorapool.worker.audit import final_audit
from lorapool.worker.dead_letter import ack_duplicate, fail_unwritable
from lorapool.worker.held import Held, Position, make_chunk, merged
from lorapool.worker.renewer import Unstarted
from lorapool.worker.sender import Sender

if TYPE_CHECKING:
    from lorapool.worker.intake import Intake
    from lorapool.worker.lease import Lease
    from lorapool.worker.state import WorkerState

logger = logging.getLogger(__name__)
MAX_BEHIND = 4  # steps whose chunks may wait for the round trip on its way


@dataclass
class _Trip:
    """One round trip of the sender: chunks to append, then entries to read."""

    outputs: list[tuple[Held, list[RequestOutput], Position]]  # a request's steps' deltas
    # new entries to read after the appends (``Intake.plan`` of the engine's free slots;
    # 0 of them: only those peers handed over; None: no read)
    read: tuple[int, int, int] | None
    extra: list = field(default_factory=list)  # (call on the sender, apply on the worker)
    sent: list | None = None  # (held, chunk, APPEND item), built on the first try


class Publisher:
    """The worker's chunks on their way to Redis; all state but the sender's is touched
    by the worker's thread only (see the module's docstring: the hand-over)."""

    def __init__(
        self,
        state: WorkerState,
        intake: Intake,
        lease: Lease,
        admit: Callable[[list], int],
    ):
        self.state, self.intake, self.lease = state, intake, lease
        self._admit = admit  # starts the entries a trip read (``Worker.start``)
        self.pending_steps = 0  # steps whose outputs wait in ``state.pending``
        self.retry: _Trip | None = None  # a trip whose send failed: sent again first
        self.next_trip = 0.0  # monotonic time before which chunks wait (max_chunk_rate)
        self._append = Appender(state.redis)
        self._sender = Sender(self._send_trip, state.name)

    def close(self) -> None:
        self._sender.close()

    def publish(self, outputs: list[RequestOutput]) -> None:
        """Queue a step's outputs for the sender (see the module's docstring)."""
        held, pending = self.state.held, self.state.pending
        for out in outputs:
            if out.request_id in held:  # else lost to another worker, or failed
                pending.setdefault(out.request_id, []).append(out)
        self.pending_steps += 1
        self.flush(wait=False)

    def flush(self, wait: bool) -> None:
        """Apply what the sender finished; hand it the pending chunks if it is free.

        ``wait``: until every chunk so far is in Redis and its trip taken back. Without
        it, waits only when ``MAX_BEHIND`` steps are pending, and before ``next_trip``
        hands over only requests' first chunks, a read and upkeep calls. A failed send
        raises here, on the worker's thread, and its batch is sent again first.
        """
        self._collect()
        if not self._sender.idle:
            if not wait and self.pending_steps < MAX_BEHIND:
                return
            self._sender.wait()
        self._collect()  # a trip that ended since the first look: back before the next
        if self.retry is not None:
            trip, self.retry = self.retry, None
            self._sender.hand(trip)
            self._sender.wait()
            self._collect()
        # before next_trip (max_chunk_rate) only first chunks (time to first token),
        # reads into free slots and upkeep calls go; the rest waits, merging
        gated = not wait and self.pending_steps < MAX_BEHIND
        gated = gated and time.monotonic() < self.next_trip
        batch = self._build_batch(first_only=gated)
        if not gated:
            self.pending_steps = 0
        state = self.state
        rate = state.config.max_chunk_rate
        if rate and batch:
            self.next_trip = max(self.next_trip, time.monotonic()) + len(batch) / rate
        # new entries for the slots the engine has free, read in the same trip, unless the
        # worker read them after this step (``Intake.between_steps``)
        engine = state.engine
        busy = engine.has_unfinished_requests() and not state.draining
        free = engine.capacity(state.config.read_ahead) if busy else 0
        read = self.intake.plan(free) if busy and (free or not gated) else None
        if state.read_between:
            read = None
        if batch or (read and read[0] > 0) or state.extra:
            state.reading = read[0] if read else 0  # before the sender may lower it
            self._sender.hand(_Trip(batch, read, state.extra))
            state.extra = []
        if wait:
            self._sender.wait()
            self._collect()

    def _build_batch(self, first_only: bool) -> list[tuple[Held, list[RequestOutput], Position]]:
        """Per pending request its steps' outputs and the position of their chunk; the
        sender merges them, builds and encodes the chunks off this thread.
        ``first_only``: only requests whose first chunk it is; the others stay pending."""
        batch, wait, holding = [], {}, self.state.held
        for rid, outs in self.state.pending.items():
            held = holding.get(rid)
            if held is None:
                continue
            if first_only and held.seq:
                wait[rid] = outs
                continue
            batch.append((held, outs, held.advance(outs)))
        self.state.pending = wait
        return batch

    def _collect(self) -> None:
        """Results of finished sends, applied; a send's failure raised (trip kept)."""
        for trip, results in self._sender.take_done():
            self.state.reading = 0
            if isinstance(results, BaseException):
                trip.read = None  # entries a lost read delivered are claimed after the lease
                self.retry = trip
                raise results
            appended, entries, extra = results
            for (held, chunk, _), result in zip(trip.sent, appended):
                if result >= NAMED and not chunk.finished:  # this entry holds the run
                    held.fenced, result = True, result - NAMED
                if result == 0 and not chunk.finished:
                    self.state.num_tokens += chunk.num_tokens
                else:
                    self._after_append(held, chunk, result)
            self._admit(entries)
            for (_, apply), result in zip(trip.extra, extra):
                if apply is not None:
                    apply(result)

    def _send_trip(self, trip: _Trip) -> tuple[list[int], list]:
        """On the sender's thread: the trip's chunks built, kept and encoded (once: a
        trip sent again after Redis went away is not built twice), one APPEND call for
        all of them, fenced, then a read of up to ``trip.read`` new entries. Returns
        (the appends' results, the entries read).

        A trip sent again: a chunk whose first send did land comes back DUPLICATE
        (or, finished, NOT_OWNER: already acked). Then the trip's upkeep calls.
        """
        if trip.sent is None:
            trip.sent = [self._build(held, outs, pos) for held, outs, pos in trip.outputs]
        items = [item for _, _, item in trip.sent]
        appended = self.append(items) if items else []
        entries = self.intake.read(trip.read, None) if trip.read is not None else []
        if trip.read is not None:  # those it brings, no longer the slots it planned for
            self.state.reading = len(entries)
        unstarted = [Unstarted(stream, entry_id.decode()) for stream, entry_id, *_ in entries]
        for entry in unstarted:  # renewed from now on, while the engine steps
            self.state.leases.add(entry)
        try:
            return appended, entries, [call() for call, _ in trip.extra]
        except BaseException:
            # the trip fails, and what it read with it (``_collect``): those entries are
            # claimed after the lease, so they must not be renewed (they were, for ever)
            for entry in unstarted:
                self.state.leases.remove(entry)
            raise

    def _build(self, held: Held, outs: list[RequestOutput], position: Position) -> tuple:
        chunk = make_chunk(held, merged(outs), self.state.name, position)
        held.keep(chunk)
        return held, chunk, self.append_item(held, chunk, final_audit(self.state, held, chunk))

    def append(self, items: list[Append]) -> list[int]:
        """One APPEND call (``lifecycle.append``) per shard the items are on (one call
        unsharded); its result per item."""
        config, consumer = self.state.config, self.state.consumer
        results = [0] * len(items)
        for keys, where in self.state.by_shard([item.stream for item in items]).items():
            shard_items = [items[i] for i in where]
            appended = self._append(
                keys, consumer, config.dead_max_len, config.log_grace_s, shard_items
            )
            for i, result in zip(where, appended):
                results[i] = result
        return results

    def append_item(
        self, held: Held, chunk: Chunk, audit: bytes, dead: bytes = b"", reason: str = ""
    ) -> Append:
        """``held`` has kept ``chunk``: a final one carries the whole output too."""
        ttl_s = held.job.result_ttl_s or self.state.config.result_ttl_s
        result = encode_result(held.whole()) if chunk.finished else b""
        return Append(
            held.request_id,
            held.entry_id,
            chunk.seq,
            encode_chunk(chunk),
            chunk.finished,
            audit,
            ttl_s,
            dead,
            reason,
            result,
            held.stream,
            fence=SKIP if held.fenced else ASK,
        )

    def _after_append(self, held: Held, chunk: Chunk, result: int) -> None:
        """Account an append (``held`` advanced past it when it was built). While this
        worker owns the entry, nobody else appends to its log, so DUPLICATE means this
        chunk already landed (a send repeated after a broken connection)."""
        rid, state = held.request_id, self.state
        state.num_tokens += chunk.num_tokens
        if state.held.get(rid) is not held:
            return  # dropped or failed meanwhile
        if result == BAD_LOG:
            fail_unwritable(state, self, held, state.keys_of(held.stream).out(rid))
            return
        if result == ANSWERED:
            state.drop(rid)
            why = "its run ended, or another entry runs it (or its submission names one)"
            ack_duplicate(state, self, rid, held.entry_id, held.stream, why)
            return
        if result == BAD_MARKER:
            logger.warning(
                "worker %s: %s finished, its run key %s holds another type than a "
                "hash (left alone; the output stays in the chunk log for its TTL)",
                state.name,
                rid,
                state.keys_of(held.stream).run(rid),
            )
        if result == VANISHED:  # acked (a final sent again) or removed: upkeep tells
            state.vanished.append(held)
            return
        if result == NOT_OWNER:
            if not chunk.finished:
                logger.warning(
                    "worker %s: lost %s to another worker (its lease ran out, another "
                    "consumer took the entry): dropping it, appending nothing more",
                    state.consumer,
                    rid,
                )
            state.drop(rid)
        elif chunk.finished:
            state.release(rid)
        elif result == 1:
            state.engine.abort_request(rid)
