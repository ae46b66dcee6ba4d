"""WorkerConfig: every option of one queue worker, validated once."""

from __future__ import annotations

import os
import socket
import uuid
from dataclasses import dataclass, field
from typing import Annotated

from msgspec import Meta

from lorapool import signing
from lorapool.config_fields import OptionError, Wait, check_fields
from lorapool.grammar_limits import DEFAULT_LIMITS, GrammarLimits
from lorapool.lifecycle.keys import DEAD_MAX_LEN, DEFAULT_PREFIX, Keys
from lorapool.records.bounds import Count, NonNegative, ResultTtl
from lorapool.records.job import DEFAULT_MAX_N, DEFAULT_MAX_PROMPT_BYTES, JobLimits

# Redis spends ~11 µs on a chunk (the APPEND script's work per item, whatever its
# tokens): 3,000 chunks/s a worker is a third of a Redis core for 10 workers, so one
# core serves 20 with a third to spare for reads, audit records and readers
DEFAULT_MAX_CHUNK_RATE = 3000

# The options' bounds, checked by ``check_fields`` (a bool is no integer, NaN no
# number; counts stay within what Redis takes). A description keeps each alias its own
# object (``config_fields.Wait`` says why).
Window = Annotated[float, Meta(ge=0, description="seconds; inf: always")]
Share = Annotated[float, Meta(gt=0, le=1, description="a share of the engine")]
Port = Annotated[int, Meta(ge=0, le=65535)]


def default_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


@dataclass
class WorkerConfig:
    """How a worker talks to the queue (engine options live in EngineArgs)."""

    prefix: str = DEFAULT_PREFIX
    # the pool's shard count on a Redis Cluster (``lifecycle.keys``; the producers' too);
    # 0: one standalone Redis, keys unsharded
    shards: int = 0
    name: str = field(default_factory=default_name)
    lease_s: Wait = 10.0  # an entry idle this long is claimable by another worker
    max_deliveries: Count = 3  # deliveries beyond this dead-letter the entry
    block_ms: Count = 100  # XREADGROUP BLOCK when the engine is idle
    burst: bool = False  # return once the queue and the engine are empty
    drain_timeout_s: Window = 30.0  # first SIGTERM: finish in-flight work up to this long
    # job markers with the whole output expire this long after the end (a job may set
    # its own)
    result_ttl_s: ResultTtl = 24 * 3600
    dead_max_len: Count = DEAD_MAX_LEN  # {p}:dead keeps about this many entries
    # a finished request's chunk log stays this long for readers following it; the
    # whole output stays, compacted into one record, for result_ttl_s
    log_grace_s: Count = 60
    # chunks a second this worker writes at most: above it, a request's tokens of several
    # steps go out as one chunk (``publisher.py``); 0: every step's tokens at once
    max_chunk_rate: NonNegative = DEFAULT_MAX_CHUNK_RATE
    # a read takes at most this worker's share of the pool's work (``intake.py``)
    fair_share: bool = True
    # requests a read may take beyond the engine's free slots, to wait in it: a job
    # behind another tenant's backlog is seen this much sooner (``intake.py``)
    read_ahead: NonNegative = 0
    # while interactive jobs come (one read in the last interactive_window_s), batch
    # jobs fill at most batch_share of the engine's sequences (``intake.py``)
    batch_share: Share = 0.5
    interactive_window_s: Window = 60.0
    # hand an entry to a live peer that has its adapter in a device slot (``intake.py``)
    affinity: bool = True
    heartbeat_s: Wait = 1.0
    alive_ttl_s: Count = 5  # status drops a worker this long after its last heartbeat
    max_prompt_bytes: int = DEFAULT_MAX_PROMPT_BYTES  # larger prompts are refused
    max_n: int = DEFAULT_MAX_N  # completions per request
    # signs audit records (default: from the environment, see lorapool.signing)
    audit_key: bytes | None = field(default_factory=signing.key_from_env, repr=False)
    insecure_no_key: bool = field(default_factory=signing.insecure_from_env)
    metrics_port: Port | None = None  # serve Prometheus metrics here (0: any free port)
    metrics_addr: str = "0.0.0.0"
    # series per adapter-labelled metric, `other` included
    metrics_max_adapters: Annotated[int, Meta(ge=2)] = 32
    metrics_vllm_names: bool = True  # kept for old command lines: vLLM's names are always on
    # a job's grammar or schema: counted against these, then compiled in a sandbox
    # process before the engine compiles it (``lorapool.grammar_sandbox``)
    grammar_limits: GrammarLimits = DEFAULT_LIMITS

    def __post_init__(self):
        check_fields(self)  # each option against its annotation
        if self.alive_ttl_s <= self.heartbeat_s:
            raise OptionError(
                "alive_ttl_s",
                f"alive_ttl_s ({self.alive_ttl_s}) must be a whole number of seconds "
                f"above heartbeat_s ({self.heartbeat_s})",
            )
        Keys(self.prefix, self.shards)  # refuses a bad prefix or shard count
        self.limits  # noqa: B018 - JobLimits checks max_prompt_bytes and max_n

    @property
    def limits(self) -> JobLimits:
        """What a job may ask for: the producers' check, run again on every entry."""
        return JobLimits(self.max_prompt_bytes, self.max_n)

    @property
    def lease_ms(self) -> int:
        return int(self.lease_s * 1000)
