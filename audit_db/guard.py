"""The writer's guard: it extends only a chain that verifies from its last signed
checkpoint, and it writes the checkpoints.

Before each batch, under the chain lock, :meth:`ChainGuard.check` makes sure the
chain up to its head can be trusted: the newest checkpoint is signed with the
audit key and matches the row at its position, ``audit_meta.keyed_from_seq``
says what the checkpoints say, and every row after the position this guard last
trusted (its own last write, else the checkpoint) verifies. Anything else raises
:class:`ChainTampered`, which the writer does not retry: it stops and says why.
A chain with rows but no checkpoint is trusted only when it has keyed rows that
verify from row 1 (a database written before checkpoints existed); one whose
rows are all unkeyed must be adopted by a key holder first (``audit checkpoint
--adopt``), since an owner who re-chained every row without the key and dropped
the checkpoints would leave exactly that.

After the rows are in, :meth:`ChainGuard.after_rows` adds a checkpoint when the
chain has none yet (the start of the keyed rows), every ``every_rows`` rows, at
least every ``every_s`` seconds, and at the last row of a month before the first
row of the next (so each monthly partition ends at one).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from sqlalchemy import Connection, inspect, select

from lorapool.audit_db import checkpoints
from lorapool.audit_db.chain import GENESIS, adapter_fingerprint
from lorapool.audit_db.checkpoints import Checkpoint
from lorapool.audit_db.schema import adapters, audit_meta
from lorapool.audit_db.walk import Walk, hashes_at, rows_after

log = logging.getLogger(__name__)
KEYED_FROM = "keyed_from_seq"


class ChainTampered(RuntimeError):
    """The chain does not verify from its last checkpoint: the writer will not extend it."""


class KeyedChainError(RuntimeError):
    """A writer without the audit key was asked to extend a keyed chain."""


@dataclass(frozen=True)
class Head:
    """The last row of the chain: position, hash, period (0, GENESIS, 0 when empty)."""

    seq: int = 0
    row_hash: str = GENESIS
    period: int = 0


@dataclass(frozen=True)
class CheckpointPolicy:
    every_rows: int = 10_000  # a checkpoint at least every this many rows
    every_s: float = 86_400.0  # and at least this often while rows come in
    folder: str | None = None  # also write each one here as a file

    def __post_init__(self):
        if self.every_rows < 1 or self.every_s <= 0:
            raise ValueError("checkpoints need every_rows >= 1 and every_s > 0")


def keyed_from(conn: Connection) -> int | None:
    """``audit_meta.keyed_from_seq``: the first keyed chain position (None: no keyed row)."""
    value = conn.execute(select(audit_meta.c.value).where(audit_meta.c.name == KEYED_FROM)).scalar()
    return None if value is None else int(value)


def adapter_rows(conn: Connection):
    """Every ``adapters`` row (pk order), with the columns its table has: one not yet
    migrated to 0008 has no hash columns, and its rows' fingerprints need none."""
    have = {c["name"] for c in inspect(conn).get_columns("adapters")}
    columns = [c for c in adapters.c if c.name in have]
    return conn.execute(select(*columns).order_by(adapters.c.pk)).mappings()


def fingerprints(conn: Connection) -> dict[int, str]:
    """adapter pk -> fingerprint, recomputed from each adapter row's identity fields."""
    return {row["pk"]: adapter_fingerprint(row) for row in adapter_rows(conn)}


@dataclass
class ChainGuard:
    """One writer's view of the chain (see the module docstring); not thread-safe."""

    key: bytes | None
    policy: CheckpointPolicy = field(default_factory=CheckpointPolicy)
    trusted: Head | None = None  # the head this guard last verified or wrote
    last: Checkpoint | None = None  # the newest checkpoint it knows
    keyed_start: int | None = None
    periods: set[int] = field(default_factory=set)  # months whose partition exists
    num_made: int = 0  # checkpoints this guard wrote
    adapter_pks: dict[str, int] = field(default_factory=dict)  # fingerprint -> pk, committed
    _new_adapters: dict[str, int] = field(default_factory=dict)
    _pending: list[Checkpoint] = field(default_factory=list)
    _fresh_head: Head | None = None
    sending: Head | None = None  # the end of the rows being inserted (chaining.ahead)

    # --- before the rows ---------------------------------------------------------

    def check(self, conn: Connection, head: Head) -> None:
        """Raise unless the chain up to ``head`` can be trusted (see the module docstring)."""
        self._pending, self._fresh_head = [], None
        meta = keyed_from(conn)
        if self.key is None:
            self._check_unkeyed(conn, meta)
            return
        newest = checkpoints.latest(conn)
        if newest is None:
            start = self._start_without_checkpoint(head, meta)
        else:
            start = self._start_at(conn, newest, meta, head)
        if start.seq > head.seq:
            raise ChainTampered(
                f"the chain ends at row {head.seq}, but row {start.seq} was written and "
                "checkpointed: rows were cut from its tail"
            )
        if start.seq < head.seq or self.trusted is None:
            self._walk(conn, start, head)
        self.trusted = head

    def _check_unkeyed(self, conn: Connection, meta: int | None) -> None:
        if meta is not None or checkpoints.latest(conn) is not None:
            raise KeyedChainError(
                f"the audit chain is keyed from row {meta}; this writer has no audit key "
                "(give it LORAPOOL_AUDIT_KEY or LORAPOOL_AUDIT_KEY_FILE)"
            )

    def _start_without_checkpoint(self, head: Head, meta: int | None) -> Head:
        if head.seq == 0:
            return Head()
        if meta is None:
            raise ChainTampered(
                f"the chain has {head.seq} rows, none of them keyed and no signed checkpoint: "
                "either it was written without the audit key (a key holder adopts it, after "
                "checking it, with `lorapool audit checkpoint --adopt`), or someone without "
                "the key re-chained it and removed its checkpoints. Refusing to extend it."
            )
        log.warning(
            "audit chain: %d rows and no checkpoint yet (written before checkpoints): "
            "verifying them all before the first one",
            head.seq,
        )
        self.keyed_start = meta
        return Head()

    def _start_at(self, conn: Connection, newest: Checkpoint, meta: int | None, head: Head) -> Head:
        bad = self._distrust(conn, newest, meta)
        if bad is not None:
            raise ChainTampered(f"{bad}. Refusing to extend the chain.")
        self.last, self.keyed_start = newest, newest.keyed_from
        if self.trusted is None or self.trusted.seq < newest.seq:
            return Head(newest.seq, newest.row_hash)
        stored = hashes_at(conn, [self.trusted.seq]).get(self.trusted.seq)
        if self.trusted.seq and stored != self.trusted.row_hash:
            raise ChainTampered(
                f"row {self.trusted.seq} changed since this writer wrote or checked it. "
                "Refusing to extend the chain."
            )
        return self.trusted

    def _distrust(self, conn: Connection, newest: Checkpoint, meta: int | None) -> str | None:
        """Why the newest checkpoint cannot be built on (None: it can)."""
        if not checkpoints.signed_by(newest, self.key):
            return f"checkpoint {newest.id} is not signed with the audit key"
        if self.last is not None and newest.id < self.last.id:
            return f"checkpoints after {newest.id} are gone (this writer made {self.last.id})"
        if meta != newest.keyed_from:
            return (
                f"audit_meta says the chain is keyed from row {meta}, its signed "
                f"checkpoints say {newest.keyed_from} (a key downgrade)"
            )
        stored = hashes_at(conn, [newest.seq]).get(newest.seq) if newest.seq else None
        if stored is not None and stored != newest.row_hash:  # None: archived
            return f"row {newest.seq} no longer has the hash of checkpoint {newest.id}"
        return None

    def _walk(self, conn: Connection, start: Head, head: Head) -> None:
        walk = Walk(
            start.seq,
            start.row_hash,
            key=self.key,
            keyed_from=self.keyed_start,
            fingerprints=fingerprints(conn),
        )
        walk.take_all(rows_after(conn, start.seq, head.seq, packed=True), stop_at_bad=True)
        if walk.first_bad is None and walk.seq != head.seq:
            reason = f"the chain should reach row {head.seq} but stops at {walk.seq}"
            raise ChainTampered(f"{reason}. Refusing to extend the chain.")
        if walk.first_bad is not None:
            raise ChainTampered(
                f"the chain does not verify from its last checkpoint: "
                f"{walk.first_bad.describe()}. Refusing to extend it."
            )

    # --- the keyed start and checkpoints -------------------------------------------

    def start_keyed(self, conn: Connection, head: Head) -> None:
        """Record the first keyed position when this is the chain's first keyed write."""
        if self.key is not None and self.keyed_start is None:
            self.keyed_start = head.seq + 1
            conn.execute(audit_meta.insert(), {"name": KEYED_FROM, "value": str(head.seq + 1)})

    def before_period(self, conn: Connection, head: Head, period: int) -> None:
        """A checkpoint at the last row of a month, before the first row of the next."""
        newest = self._newest()
        if self.key is None or head.seq == 0 or period <= head.period:
            return
        if newest is None or newest.seq != head.seq:
            self.add(conn, head, time.time())

    def after_rows(self, conn: Connection, head: Head, now: float) -> None:
        """Add a checkpoint at ``head`` when one is due (see the module docstring)."""
        newest = self._newest()
        if self.key is None:
            return
        due = (
            newest is None
            or head.seq - newest.seq >= self.policy.every_rows
            or now - newest.created_at >= self.policy.every_s
        )
        if due:
            self.add(conn, head, now)
        self._fresh_head = head

    def heartbeat_due(self, now: float) -> bool:
        """True when an idle writer should checkpoint (the newest one is older than
        ``every_s``)."""
        return (
            self.key is not None
            and self.last is not None
            and (now - self.last.created_at >= self.policy.every_s)
        )

    def adopt(self, conn: Connection, head: Head) -> None:
        """Verify a chain that has no checkpoint as it is, and make it the start of the
        keyed chain (``audit checkpoint --adopt``)."""
        if checkpoints.latest(conn) is not None:
            raise ChainTampered("the chain already has signed checkpoints: nothing to adopt")
        meta = keyed_from(conn)
        log.warning("audit chain: adopting %d rows written without checkpoints", head.seq)
        self.keyed_start = meta
        self._walk(conn, Head(), head)
        if meta is None:
            self.keyed_start = head.seq + 1
            conn.execute(audit_meta.insert(), {"name": KEYED_FROM, "value": str(head.seq + 1)})
        self.add(conn, head, time.time())
        self.trusted = head

    def _newest(self) -> Checkpoint | None:
        return self._pending[-1] if self._pending else self.last

    def add(self, conn: Connection, head: Head, now: float) -> None:
        """Add a checkpoint at ``head`` (in this transaction)."""
        made = checkpoints.make(
            self._newest(), head.seq, head.row_hash, self.keyed_start, now, self.key
        )
        checkpoints.insert(conn, made)
        self._pending.append(made)

    # --- after the commit ----------------------------------------------------------

    def known_pks(self) -> dict[str, int]:
        """fingerprint -> pk of every adapter committed or stored by this transaction."""
        return {**self.adapter_pks, **self._new_adapters}

    def new_adapters(self, found: dict[str, int]) -> dict[str, int]:
        """Adapter pks this transaction found or stored: known once it commits."""
        self._new_adapters.update(found)
        return found

    def committed(self) -> list[Checkpoint]:
        """The transaction committed: take its head and checkpoints as trusted (and write
        the checkpoint files); returns the checkpoints it made."""
        self.adapter_pks.update(self._new_adapters)
        self._new_adapters, self.sending = {}, None
        made, self._pending = self._pending, []
        if made:
            self.last = made[-1]
            self.num_made += len(made)
        if self._fresh_head is not None:
            self.trusted, self._fresh_head = self._fresh_head, None
        if self.policy.folder:
            for checkpoint in made:
                checkpoints.export(checkpoint, self.policy.folder)
        return made

    def rolled_back(self) -> None:
        """The transaction rolled back: forget what it did, as the database did. Its
        keyed start (``audit_meta`` was not written: the next write records it) and the
        partitions it made are gone too; a rejected first batch left both behind, so
        the next batch checkpointed a keyed start that ``audit_meta`` lacked and the
        writer then refused its own chain as a key downgrade."""
        self._pending, self._fresh_head, self._new_adapters = [], None, {}
        self.trusted, self.sending = None, None  # verify again from the checkpoint next time
        self.keyed_start = self.last.keyed_from if self.last is not None else None
        self.periods.clear()  # made again (if missing) by the next write
