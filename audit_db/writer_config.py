"""What an audit writer is told (:class:`WriterConfig`) and what it reports
(:class:`WriterStats`)."""

from __future__ import annotations

import gc
import os
import socket
from dataclasses import dataclass, field

from lorapool import signing
from lorapool.audit_db.guard import CheckpointPolicy
from lorapool.lifecycle.keys import DEAD_MAX_LEN, DEFAULT_PREFIX


def default_consumer() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


@dataclass(frozen=True)
class WriterConfig:
    """How one audit writer consumes ``{p}:audit``."""

    prefix: str = DEFAULT_PREFIX
    shards: int = 0  # the pool's shard count (``lifecycle.keys``): every shard's stream is read
    consumer: str = field(default_factory=default_consumer)
    batch_size: int = 500
    # read the next batch before this one is stored and parse it while PostgreSQL
    # inserts this one (writer_batch.NextBatch; RESULTS.md, session 6)
    prefetch: bool = True
    block_ms: int = 1000
    claim_idle_ms: int = 60_000
    claim_every_s: float = 10.0
    backoff_initial_s: float = 0.1
    backoff_max_s: float = 10.0
    # PostgreSQL: a write transaction stuck this long (its writer stopped mid-batch, a
    # lock held by one) is ended by the server and retried (database.with_stall_timeout);
    # a healthy batch takes well under a second (docs/audit-roles.md). None: never
    db_stall_timeout_s: float | None = 10.0
    migrate: bool = False  # run the migrations on start instead of waiting for them
    checkpoint_rows: int = 10_000  # a signed checkpoint at least every this many rows
    checkpoint_interval_s: float = 86_400.0  # and at least this often (idle or not)
    checkpoint_dir: str | None = None  # also write each checkpoint here (write-once storage)
    rollup_rows: int = 10_000  # refresh the usage rollup after this many rows
    rollup_interval_s: float = 60.0  # or this long after the last refresh
    dead_max_len: int = DEAD_MAX_LEN  # {p}:dead keeps about this many entries
    # the audit key (default: from the environment); None only with insecure_no_key
    audit_key: bytes | None = field(default_factory=signing.key_from_env, repr=False)
    insecure_no_key: bool = field(default_factory=signing.insecure_from_env)

    def __post_init__(self):
        signing.require_key(self.audit_key, self.insecure_no_key)
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {self.batch_size}")
        if self.backoff_initial_s <= 0 or self.backoff_max_s < self.backoff_initial_s:
            raise ValueError("backoff must satisfy 0 < backoff_initial_s <= backoff_max_s")
        self.checkpoint_policy()  # checks the checkpoint settings
        if self.db_stall_timeout_s is not None and not self.db_stall_timeout_s >= 0.1:
            raise ValueError(f"db_stall_timeout_s must be >= 0.1, got {self.db_stall_timeout_s}")
        if self.rollup_rows < 1 or not self.rollup_interval_s > 0:
            raise ValueError("the rollup needs rollup_rows >= 1 and rollup_interval_s > 0")

    def checkpoint_policy(self) -> CheckpointPolicy:
        return CheckpointPolicy(
            self.checkpoint_rows, self.checkpoint_interval_s, self.checkpoint_dir
        )


@dataclass
class WriterStats:
    """What one writer has done since it started; ``run`` returns it."""

    entries: int = 0  # stream entries handled and acked, redeliveries and dead ones included
    rows_written: int = 0  # completion rows stored
    duplicates: int = 0  # rows skipped as identical to the stored row (a redelivery)
    dead_lettered: int = 0  # entries moved to {p}:dead
    conflicts: int = 0  # rows that contradict the stored row, kept in the conflicts table
    db_retries: int = 0  # database calls that failed and were tried again (Redis ones are not)
    checkpoints: int = 0  # signed checkpoints written
    chained_ahead: int = 0  # batches stored as chained while the one before was inserted


# The writer's rows are freed by reference counts, yet a batch's containers, alive
# together, set off the cyclic collector every 700 allocations: 24 µs of CPU a row,
# ~20% of the writer's, with the modules' objects traversed again and again
# (RESULTS.md, helper 53; 1.6 µs a row with the settings below).
GC_GEN0 = 50_000


def own_the_collector(gen0: int = GC_GEN0) -> None:
    """For a process that is a writer's own (``lorapool audit-writer``, the benchmarks):
    freeze what is loaded so far out of the cyclic collector, and collect the youngest
    generation every ``gen0`` net allocations. Cycles are still collected, less often."""
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(gen0, gen1, gen2)
