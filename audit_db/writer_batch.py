"""A batch of the audit writer: its stream entries as items, and the next batch, read
before the one in hand is stored and made ready while the server inserts it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from lorapool.audit_db import chaining, store
from lorapool.audit_db.guard import ChainGuard
from lorapool.lifecycle.keys import Keys
from lorapool.records.audit import AuditRecord

# entries of the next batch parsed a call of ``NextBatch.work``
PARSE_SLICE = 50


@dataclass
class Item:
    """One stream entry and the rows it became."""

    view: Keys  # the shard view its entry was read from
    entry_id: bytes | str
    payload: bytes | str | None
    rows: list[store.PreparedRow]
    record: AuditRecord | None = None
    dead: bool = False
    error: str | None = None  # why it is to be dead-lettered (done when its batch is taken up)


@dataclass
class NextBatch:
    """The next batch, read before the one in hand is stored, and made ready a slice a
    call once that one's rows are sent, while the server inserts them (the
    ``meanwhile`` of ``store.append``, bulk.py), in the writer's own thread: parsed,
    then chained and encoded onto the rows being inserted (``chaining.ahead``; used
    only if that still holds when its turn comes). The parse thread this replaces
    bought no overlap on a two-core box with the database local: the server inserted
    only after the COPY's end, and the thread's GIL switches cost a quarter of the
    writer's CPU (RESULTS.md)."""

    view: Keys
    entries: list
    parse: Callable[[Keys, object], Item]
    guard: ChainGuard
    # the batch stored before, freed by the first call: its objects' deallocation took
    # ~12 µs a row at the end of each step, the server idle (RESULTS.md, session 6)
    retired: object = None
    items: list[Item] = field(default_factory=list)
    early: chaining.Ahead | None = None
    _chained: bool = False

    def work(self) -> bool:
        """Do the next slice of work; False once all is done."""
        self.retired = None
        done = len(self.items)
        if done < len(self.entries):
            batch = self.entries[done : done + PARSE_SLICE]
            self.items.extend(self.parse(self.view, entry) for entry in batch)
            return True
        if not self._chained:
            self._chained = True
            rows = [row for item in self.items if item.error is None for row in item.rows]
            self.early = chaining.ahead(rows, self.guard)
            return True
        return False

    def finish(self) -> NextBatch:
        while self.work():
            pass
        return self
