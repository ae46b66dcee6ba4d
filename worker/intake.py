"""What a worker reads, in which order and how much of it.

- **Priority.** The job streams are read first to last (``Keys.streams``): the
  batch stream only with the capacity the interactive one left; and while
  interactive jobs come (one read in the last ``--interactive-window``, 60 s),
  batch jobs fill at most ``--batch-share`` (0.5) of the engine's sequences, so
  that interactive jobs arriving beside a batch find free slots instead of
  waiting for batch lines to end. A pool that serves only batches uses all.
- **Fair share of a burst.** A read takes at most this worker's share of the
  pool's work: the entries not yet read plus those pending, over the live
  workers, less what this worker holds (at least one, never more than the
  engine's capacity, so backpressure stays). Two idle workers given a burst of
  64 jobs take about 32 each, where the first to read used to take all it could
  admit. The live workers are counted at each heartbeat (``alive`` keys). Off
  with ``--no-fair-share`` (``WorkerConfig.fair_share``).
- **Read-ahead** (``--read-ahead``, 0 by default). A read takes up to that many
  entries beyond the engine's free slots; they wait in the engine, whose tenants'
  fair share picks among them (``engine.fair_share``), and are renewed as held ones
  are. The stream is read in order, so a job behind B entries of others is read once
  B - max_num_seqs - read_ahead of them have ended (B - max_num_seqs without); the
  worker reads at most max_num_seqs + read_ahead requests (backpressure; entries that
  peers hand it come on top, see below). Entries
  read ahead are not free for a worker that starts meanwhile (why it is off by
  default). Only interactive entries are read ahead: the batch room is counted on the
  free slots alone.
- **Adapter affinity** (no central router). A new entry for an adapter not in
  a device slot here goes to a live peer whose last heartbeat (at most
  ``heartbeat_s`` old) shows that adapter in a device slot, the least loaded of
  them; when no live worker shows it, to the adapter's home (rendezvous hashing
  over the live workers), so that each rarely used adapter loads on one worker
  rather than on all. Only to a peer whose load (running and waiting requests,
  and those handed to it since its heartbeat) is at most ``AFFINITY_SLACK``
  above this worker's, else it runs here. The entry
  moves to the peer's pending list (XCLAIM, its delivery count unchanged) and
  its id onto the peer's handoff list (``HANDOFF``). The peer takes its handed
  entries first at its next read, whatever its capacity (they wait in its
  engine as they would here). Bounds: an entry is handed at most once (a peer
  never hands it on; a claimed or resumed one never moves); it waits one of the
  peer's round trips (its step, or ``block_ms`` when idle), or, should the peer
  die or stop first, the lease, after which any worker claims it. Off with
  ``--no-affinity`` (``WorkerConfig.affinity``).
- **Shards** (a Redis Cluster, ``--shards N``): one ``READ`` per shard a round
  trip, each shard's share counted on its own (its work, the entries held from
  it); with nothing to read, the blocking read waits on one shard at a time, in
  turn, so an idle worker finds a new job on another shard within ``block_ms`` times
  the shard count at worst.
"""

from __future__ import annotations

import logging
import math
import time
import zlib
from collections import Counter
from typing import TYPE_CHECKING

import redis

from lorapool.connection import REDIS_DOWN
from lorapool.lifecycle.intake import Handoff, Read
from lorapool.lifecycle.keys import WORKERS_GROUP
from lorapool.records.heartbeat import Heartbeat, consumer_of
from lorapool.worker.pool import loaded_adapters
from lorapool.worker.renewer import Unstarted

if TYPE_CHECKING:
    from lorapool.worker.state import WorkerState

logger = logging.getLogger(__name__)
# a busy engine's entries are read between its steps while that costs at most this
# share of a step's time (``Intake.between_steps``; at 0.05, the read of a 7 ms step on a
# 2-core box, ~0.35 ms, was made and skipped by turns: RESULTS.md)
READ_SHARE = 0.10
# a peer is handed an entry while its load (requests running and waiting, and handed
# to it since its heartbeat) is at most this much above this worker's
AFFINITY_SLACK = 4


def home_of(adapter: str, workers: list[str]) -> str:
    """Of ``workers``, the one an adapter that none holds goes to: the highest of
    crc32(adapter, worker) (rendezvous hashing, the same answer in every worker that
    sees the same pool; a worker joining or leaving moves only its share)."""
    return max(workers, key=lambda w: zlib.crc32(f"{adapter}\0{w}".encode()))


class Intake:
    """The worker's reads of new entries (``READ``, one round trip each).

    ``read`` (a ``plan``'s, without blocking) runs on the sender's thread too: it reads
    the pool view (``live_workers``), which the worker's thread changes only while no
    trip is out (a heartbeat's result is applied with its trip's)."""

    def __init__(self, state: WorkerState):
        self.state = state
        self.live_workers = 1  # set by the worker's heartbeat
        self.peers: dict[str, Heartbeat] = {}  # live peers' last heartbeat records
        self.handed = Counter()  # entries handed to each peer since its record
        self.handed_total = 0
        self._here: set[str] | None = None  # adapters in device slots here, for a read
        self.interactive_at = -math.inf  # when an interactive entry was last read
        self._load = 0  # requests running and waiting here, for a read
        self._interactive = {view.requests for view in state.keys.shard_views}
        self._turn = 0  # the shard the next blocking read waits on
        self._between_s = 0.0  # what a read between steps takes (moving average; 0: none)
        self._read_script = Read(state.redis)
        self._handoff = Handoff(state.redis)

    def queue_empty(self) -> bool:
        """Nothing held here, nothing pending anywhere (``--burst`` stops then)."""
        return not self.state.held and all(
            self.state.redis.xpending(stream, WORKERS_GROUP)["pending"] == 0
            for stream in self.state.streams
        )

    def pool_seen(self, live: list[Heartbeat]) -> None:
        """The live workers' records, from a heartbeat."""
        self.live_workers = max(1, len(live))
        me = self.state.consumer
        self.peers = {consumer_of(r): r for r in live if consumer_of(r) != me}
        self.handed.clear()

    def new_read(self, entries: list) -> None:
        """``entries`` were read: what is loaded here is looked at again for them."""
        self._here = None
        if any(stream in self._interactive for stream, *_ in entries):
            self.interactive_at = time.monotonic()

    def hand_off(self, held) -> bool:
        """Give a new entry to the peer that holds its adapter, if one can take it
        (see the module's docstring); True when it went."""
        lora = held.job.lora_request
        if lora is None or not self.state.config.affinity or not self.peers:
            return False
        if self._here is None:
            self._here = set(loaded_adapters(self.state.engine))
            self._load = sum(self.state.engine.request_counts())
        name = lora.lora_name
        if name in self._here:
            return False
        holding = [p for p in self.peers.values() if name in p.loaded]
        peer = min((p for p in holding if self._can_take(p)), key=self._peer_load, default=None)
        if peer is None and not holding:
            peer = self.peers.get(self.home(name))
            peer = peer if peer is not None and self._can_take(peer) else None
        if peer is None:
            return False
        self.handed[consumer_of(peer)] += 1
        self.handed_total += 1
        self._send([(held.stream, held.entry_id, consumer_of(peer))])
        return True

    def _peer_load(self, peer: Heartbeat) -> int:
        """Requests running and waiting at the peer's last heartbeat, and handed since."""
        return peer.running + peer.waiting + self.handed[consumer_of(peer)]

    def _can_take(self, peer: Heartbeat) -> bool:
        try:
            load = self._peer_load(peer)
        except TypeError:  # a record of another version, without its load
            return False
        return not peer.draining and load <= self._load + AFFINITY_SLACK

    def home(self, adapter: str) -> str:
        """The live worker an adapter that no worker holds goes to (``home_of``)."""
        return home_of(adapter, [self.state.consumer, *self.peers])

    def _send(self, items: list[tuple[str, str, str]]) -> None:
        """HANDOFF for ``items`` (stream, entry, peer): at once when the engine is idle,
        else on the sender's next round trip (the engine never waits for it)."""
        name, ttl_s = self.state.consumer, self._list_ttl_s()
        shards = self.state.by_shard([stream for stream, _, _ in items]).items()
        calls = [(keys, [items[i] for i in where]) for keys, where in shards]
        call = lambda: [self._handoff(keys, name, ttl_s, its) for keys, its in calls]  # noqa: E731
        if self.state.engine.has_unfinished_requests():
            self.state.extra.append((call, None))
        else:
            call()

    def _list_ttl_s(self) -> int:
        """A handoff list outlives its entries' lease by far: claimed by then."""
        return max(60, int(self.state.config.lease_s * 10))

    def plan(self, count: int) -> tuple[int, Counter, int]:
        """(count, entries held per shard view, batch room) for a read of up to
        ``count``: taken on the worker's thread, whose ``held`` the sender's thread must
        not iterate."""
        keys_of = self.state.keys_of
        held = Counter(keys_of(h.stream) for h in self.state.held.values())
        free = max(0, count - self.state.config.read_ahead)  # read-ahead: interactive only
        return count, held, self._batch_room(free)

    def between_steps(self, step_s: float) -> list[tuple[str, bytes, dict, bool]]:
        """New entries for a busy engine's free slots, read on the worker's thread after
        a step (of ``step_s``) and before its chunks go to the sender, so that an entry
        that came during the step runs in the next one. (The sender's round trip runs
        during the next step: an entry it reads waits a step more. It reads them still
        when this read is not made or fails: ``state.read_between``. It never raises:
        the step's outputs are not queued yet. A trip still on its way with a read
        keeps its count of the free slots: ``state.reading``.)

        Made while slots are free, not draining, and the read (one READ a shard, timed
        here, a moving average) costs at most ``READ_SHARE`` of the step: a step less to
        the first token for at most 10% more time a step (20 ms steps on a 2-core box:
        1-3.5%, ``bench busy_gaps``); a short step's engine (a small model, many shards) reads
        as before, trying again now and then."""
        state, engine = self.state, self.state.engine
        state.read_between = False
        if state.draining or not engine.has_unfinished_requests():
            return []
        if self._between_s > READ_SHARE * step_s:
            self._between_s *= 0.99  # tried again within ~100 such steps: a slow read passes
            return []
        count = engine.capacity(state.config.read_ahead) - state.reading  # the trip's own
        if count <= 0:
            return []
        start = time.monotonic()
        try:
            entries = self.read(self.plan(count), None, one_pass=True)
            state.read_between = True
        except (*REDIS_DOWN, redis.ResponseError) as exc:  # the round trip meets it too
            logger.debug("worker %s: no read between steps (%s)", state.name, exc)
            entries = []  # any it delivered are claimed after the lease
        for stream, entry_id, *_ in entries:  # renewed until started, as a trip's are
            state.leases.add(Unstarted(stream, entry_id.decode()))
        spent = time.monotonic() - start
        self._between_s = spent if not self._between_s else 0.8 * self._between_s + 0.2 * spent
        return entries

    def read(
        self, plan: tuple[int, Counter, int], block: int | None, one_pass: bool = False
    ) -> list[tuple[str, bytes, dict, bool]]:
        """The entries peers handed to this worker, and up to ``count`` new ones (a
        ``plan``), each (stream, entry id, fields, handed). ``block`` (ms): when there is
        none, wait up to that long for one on any stream (of one shard, in turn), then
        read the rest at once. ``one_pass``: sharded, one READ a shard (each shard's
        interactive stream before its batch one), not a pass for the interactive streams
        of every shard and then one for the batch streams: the read between a busy
        engine's steps, which finds nothing most of the time, costs a round trip a shard,
        not two."""
        count, held, room = plan
        entries = self._read(count, held, room, one_pass)
        if entries or block is None:
            return entries
        views = self.state.keys.shard_views
        self._turn = (self._turn + 1) % len(views)
        reply = self.state.redis.xreadgroup(
            WORKERS_GROUP,
            self.state.consumer,
            dict.fromkeys(views[self._turn].streams, ">"),
            count=1,
            block=block,
        )
        entries = [(s.decode(), i, f, False) for s, got in reply or [] for i, f in got]
        if entries and count > len(entries):
            batch = sum(1 for e in entries if e[0] not in self._interactive)
            held = held + Counter(self.state.keys_of(e[0]) for e in entries)
            entries += self._read(count - len(entries), held, room - batch)
        return entries

    def _batch_room(self, count: int) -> int:
        """How many batch entries to take at most now: while interactive jobs come
        (one read in the last ``interactive_window_s``), batch jobs fill no more than
        ``batch_share`` of the engine's sequences (those held plus ``count`` free), so
        that the next interactive job finds a free slot; else all of them."""
        config = self.state.config
        held = self.state.held.values()
        total = len(held) + count
        if time.monotonic() - self.interactive_at < config.interactive_window_s:
            total = max(1, int(config.batch_share * total))
        batch = sum(1 for h in held if h.stream and h.stream not in self._interactive)
        return max(0, total - batch)

    def _read(
        self, count: int, held: Counter, room: int, one_pass: bool = False
    ) -> list[tuple[str, bytes, dict, bool]]:
        """One READ per shard (the handed entries of each, then new ones while
        ``count`` lasts). Sharded, the interactive streams of every shard come first:
        a first pass with no batch room, then, with ``count`` and room left, a pass
        for the batch streams (one READ unsharded: the script keeps the order), unless
        ``one_pass``."""
        views = self.state.keys.shard_views
        live = self.live_workers if self.state.config.fair_share else 1
        passes = [room] if len(views) == 1 or one_pass else [0, room]
        read: list[tuple[str, bytes, dict, bool]] = []
        held = Counter(held)  # the plan's own stays as it was
        for i, batch_room in enumerate(passes):
            if i > 0 and (count <= 0 or room <= 0):
                break
            for keys in views:
                reply = self._read_script(
                    keys,
                    self.state.consumer,
                    max(0, count),
                    live,
                    held[keys],
                    max(0, min(room, batch_room)),
                )
                for entry in reply:
                    read.append(entry)
                    stream, _, _, handed = entry
                    if not handed:
                        count -= 1
                        room -= stream != keys.requests  # past the first stream: batch
                        held[keys] += 1
        return read
