"""The gateway's one validated configuration."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from msgspec import Meta

from lorapool.config_fields import check_fields
from lorapool.egress import EgressPolicy
from lorapool.grammar_limits import DEFAULT_LIMITS, GrammarLimits
from lorapool.lifecycle.keys import DEFAULT_PREFIX
from lorapool.protocol import MAX_STOP
from lorapool.records.bounds import FINITE
from lorapool.records.job import DEFAULT_MAX_N, DEFAULT_MAX_PROMPT_BYTES
from lorapool.tool_calls import PARSERS

# A request body may hold a whole prompt (max_prompt_bytes) JSON-escaped: up to 6
# bytes a character for control characters, plus the other fields.
BODY_OVERHEAD = 64 << 10

Limit = Annotated[int, Meta(ge=0)]  # a count the deployment sets (no wire bound)
# (each with a description: typing caches Annotated by equal arguments, Meta(gt=0) equals
# bounds.RepetitionPenalty's Meta(gt=0.0), and whichever was made first would word the bound)
Timeout = Annotated[float, Meta(gt=0, le=FINITE, description="seconds")]
RedisWait = Annotated[
    float, Meta(gt=0, le=3600, description="seconds: a Redis call's, an outage's")
]


@dataclass(frozen=True)
class GatewayConfig:
    """redis_url: the pool's Redis; prefix: its key prefix.

    max_prompt_bytes, max_n: refused at submit as the workers would (413, 400).
    max_body_bytes: larger bodies get 413 before they are parsed (default: room for
    a max_prompt_bytes prompt, escaped). max_prompts: prompts in one completions call.
    max_stop: stop strings an OpenAI or job request may name (OpenAI's 4 by default; at
    most ``protocol.MAX_STOP``, which also bounds each string's and all their characters).
    result_timeout_s: how long a non-streaming call waits for its result (then 504,
    and the job is aborted). queue_timeout_s: how long an OpenAI call's job may wait
    for a worker to take it (a pool scaled to zero starts one meanwhile); past it the
    call gets 503 ``no_worker`` (a stream, an error event) and the job stays queued.
    redis_retries: retries of a Redis call before 503. redis_timeout_s: how long a Redis
    call may go unanswered (then it fails). A request meeting a stalled Redis gets 503
    once the gateway's watch notices (within a second: ``gateway/edge.py``), at most
    ``request_bound_s`` (the calls' own timeouts, should the watch not notice).
    redis_outage_s: how long streams and calls already waiting for results wait for
    Redis to come back before they end with a 503 (``gateway/redis_watch.py``).
    events_max_s: a job-events response ends (cleanly) after this long; the browser's
    EventSource reconnects with Last-Event-ID, which lets a load balancer spread
    long-lived streams again (None: open until the job's final chunk).
    adapter_admin: serve /v1/load_lora_adapter and /v1/unload_lora_adapter (role admin),
    registering only inside adapter_roots (none: $LORAPOOL_ADAPTER_ROOTS, else anywhere).
    audit_db_url: serve /v1/audit/* from this database (give a read-only role's URL);
    None: those routes answer 404. audit_db_schema: its PostgreSQL schema.
    cors_origins: browser origins allowed to call the gateway (none: no CORS headers).
    auth: every /v1 route needs an API key of the right role (``lorapool keys``);
    off, the gateway trusts its network and knows no tenants.
    redis_connections: Redis connections the gateway opens at most; calls past them
    wait for one (the Pub/Sub connection that follows every stream is one).
    tool_call_parser: how ``tool_choice="auto"`` replies are read for calls: hermes,
    llama3_json, or auto (from the base model's name; ``lorapool.tool_calls``).
    max_backlog: submits get 429 (with Retry-After: retry_after_s) while this many
    entries of the request stream wait for a worker (None: no bound).
    webhook_allow: internal networks and host names a job's ``on_finish`` may name
    (``lorapool.egress``; every other inward URL gets 400 at submit).
    trust_proxy: the gateway stands behind a TLS-terminating proxy whose
    X-Forwarded-Proto/-For/-Host it believes (dashboard cookies are then Secure).
    session_ttl_s: a dashboard session's lifetime (``gateway/dashboard_session.py``).
    max_streams_per_tenant, max_streams: long-lived requests (job-events streams, OpenAI
    ``stream: true`` calls, uploads, downloads) one tenant may hold open at once (429 past it),
    and all of them together (503 past it); 0: no cap (``gateway/holds.py``).
    tenant_audit_internals: a tenant's auditor sees its rows' adapter paths, worker
    names and key ids too (by default only admin keys and auditors of every tenant do).
    grammar_limits: the limits on a structured output's shape, each refused with a 400
    naming it (``lorapool.grammar_limits``). heavy_workers: grammar compiles (in sandbox
    processes) and tokenizations that run at once, each kind off the event loop
    (``gateway/heavy.py``); more wait their turn. turns_per_tenant: requests of one
    API key looked up, read and prepared at once, until their jobs are submitted; its
    others wait before that (``gateway/turns.py``; 0: no turns).
    """

    redis_url: str
    prefix: str = DEFAULT_PREFIX
    shards: int = 0  # the pool's shard count on a Redis Cluster (``lorapool.lifecycle.keys``)
    max_prompt_bytes: Limit = DEFAULT_MAX_PROMPT_BYTES
    max_n: Limit = DEFAULT_MAX_N
    max_body_bytes: Annotated[int, Meta(ge=1)] | None = None
    max_prompts: Limit = 128
    max_stop: Annotated[int, Meta(ge=0, le=MAX_STOP)] = 4
    result_timeout_s: Timeout = 600.0
    queue_timeout_s: Timeout = 300.0
    redis_retries: Limit = 1
    redis_timeout_s: RedisWait = 2.0
    redis_outage_s: RedisWait = 30.0
    auth: bool = True
    max_backlog: Limit | None = None
    cors_origins: tuple[str, ...] = ()
    events_max_s: Timeout | None = None
    adapter_admin: bool = False
    audit_db_url: str | None = None
    audit_db_schema: str | None = None
    adapter_roots: tuple[str, ...] = ()
    retry_after_s: Limit = 1
    tool_call_parser: str = "auto"
    redis_connections: Annotated[int, Meta(ge=2)] = 64
    webhook_allow: tuple[str, ...] = ()
    trust_proxy: bool = False
    session_ttl_s: Annotated[int, Meta(ge=1)] = 3600
    max_streams_per_tenant: Limit = 64
    max_streams: Limit = 1024
    tenant_audit_internals: bool = False
    grammar_limits: GrammarLimits = DEFAULT_LIMITS
    heavy_workers: Annotated[int, Meta(ge=1, le=64)] = 2
    turns_per_tenant: Limit = 1

    def __post_init__(self):
        check_fields(self)
        EgressPolicy(tuple(self.webhook_allow))  # raises ValueError naming a bad entry
        if self.tool_call_parser not in ("auto", *PARSERS):
            raise ValueError(f"tool_call_parser must be auto or one of {', '.join(PARSERS)}")

    def redis_options(self) -> dict:
        """The socket options of every Redis client of the gateway: a call that gets no
        answer in ``redis_timeout_s`` fails (and is retried ``redis_retries`` times)."""
        timeout = self.redis_timeout_s
        return {"socket_timeout": timeout, "socket_connect_timeout": timeout}

    @property
    def request_bound_s(self) -> float:
        """The longest one Redis call of a request waits on a stalled Redis before its
        503, should the watch not notice first: a connection's wait for a pooled one to
        free itself (whose call times out), then each try of the call (and the backoff
        between them)."""
        return self.redis_timeout_s * (2 + self.redis_retries) + 0.2 * self.redis_retries

    @property
    def body_limit(self) -> int:
        if self.max_body_bytes is not None:
            return self.max_body_bytes
        return 6 * self.max_prompt_bytes + BODY_OVERHEAD
