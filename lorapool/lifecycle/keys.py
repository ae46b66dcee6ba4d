"""Every Redis key name lorapool uses, in one place.

Two layouts. Unsharded (``shards=0``, the default, one standalone Redis): keys are
``<prefix>:<name>``, and per-request keys wrap the request id in a hash tag.
Sharded (``shards=N``, for a Redis Cluster): a request lives on shard
``crc32(request id) % N``, and every key of shard ``s`` (its job streams, dead and
audit streams, handoff lists, and its requests' job, run, out and abort keys) carries the
hash tag of the shard, ``{<prefix>:<s>-<k>}`` (``shard_tag``), so that each script of
the queue touches one slot, and that slot lies in the middle of the s-th N-th of the
slot space: with N masters holding the contiguous slot ranges ``redis-cli --cluster
create`` gives them, each master holds one shard. The
pool's own keys (adapter registry, model, heartbeats, API keys, rates, batches) carry
``{<prefix>}``, the meta shard. ``Keys.on(s)`` names shard ``s``'s keys; a worker
reads every shard (``Keys.shard_views``) and writes a request's keys on the shard its
entry came from.
"""

import binascii
import zlib
from dataclasses import dataclass, replace
from functools import lru_cache

DEFAULT_PREFIX = "lorapool"
WORKERS_GROUP = "workers"
AUDIT_GROUP = "audit"
# {p}:dead keeps about this many entries (XADD MAXLEN ~): a dead-lettered request's
# error record also reaches the audit table, so trimming loses only the raw payload.
DEAD_MAX_LEN = 10_000
# A job's priority names the stream it goes to; workers read them in this order, the
# next only with capacity left after the one before (see ``Keys.stream``).
PRIORITIES = ("interactive", "batch")


MAX_SHARDS = 1024
SLOTS = 16384  # a Redis Cluster's hash slots


@lru_cache(maxsize=4096)
def shard_tag(prefix: str, shard: int, shards: int) -> str:
    """The hash tag of shard ``shard`` of ``shards``: ``<prefix>:<shard>-<k>`` with the
    least k whose slot lies in the middle half of the shard's N-th of the slot space
    (``[s * 16384 / N, (s + 1) * 16384 / N)``; the whole of it when that is under 4
    slots), so that a cluster of N masters, with the ranges ``redis-cli --cluster
    create`` assigns, holds one shard on each. A tag's slot is CRC16 of it: about N
    tries a shard, made once per process."""
    low, high = shard * SLOTS // shards, (shard + 1) * SLOTS // shards
    if high - low >= 4:
        low, high = low + (high - low) // 4, high - (high - low) // 4
    k = 0
    while not low <= tag_slot(f"{prefix}:{shard}-{k}") < high:
        k += 1
    return f"{prefix}:{shard}-{k}"


def tag_slot(tag: str) -> int:
    """The cluster slot of every key tagged ``{tag}``: CRC16 (XMODEM) of it, mod 16384."""
    return binascii.crc_hqx(tag.encode("utf-8", "surrogatepass"), 0) % SLOTS


def _shard_key(name: str, doc: str) -> property:
    """A key of each shard (one view's: ``Keys.on``), ``<shard's tag>:<name>``."""
    return property(lambda keys: keys._in_shard(name), doc=doc)


def _meta_key(name: str, doc: str) -> property:
    """A key of the pool's own, on the meta shard: ``<meta tag>:<name>``."""
    return property(lambda keys: keys._meta(name), doc=doc)


def _request_key(name: str, doc: str):
    """A key of one request, on its shard: ``Keys.<name>(request_id)``."""

    def key(keys: "Keys", request_id: str) -> str:
        return keys._of_request(name, request_id)

    key.__name__, key.__doc__ = name, doc
    return key


@dataclass(frozen=True)
class Keys:
    prefix: str = DEFAULT_PREFIX
    shards: int = 0  # 0: the unsharded layout; N: N shards, each on its own hash tag
    shard: int | None = None  # a view of one shard (``on``); None: by request id

    def __post_init__(self):
        if not self.prefix or any(c in self.prefix for c in "{} \n"):
            raise ValueError(f"invalid key prefix {self.prefix!r}")
        if type(self.shards) is not int or not 0 <= self.shards <= MAX_SHARDS:
            raise ValueError(
                f"shards must be an integer from 0 to {MAX_SHARDS}, got {self.shards!r}"
            )
        if self.shard is not None and not 0 <= self.shard < max(self.shards, 1):
            raise ValueError(f"shard {self.shard!r} is not one of the pool's {self.shards}")

    def shard_of(self, request_id: str) -> int:
        """The shard that holds ``request_id``'s entry and keys (0 when unsharded)."""
        if self.shard is not None:
            return self.shard
        if not self.shards:
            return 0
        return zlib.crc32(request_id.encode("utf-8", "surrogatepass")) % self.shards

    def on(self, shard: int) -> "Keys":
        """The keys of one shard (``shard`` 0 of an unsharded pool: these keys)."""
        return replace(self, shard=shard)

    def for_request(self, request_id: str) -> "Keys":
        """The keys of the shard that holds ``request_id``."""
        return self.on(self.shard_of(request_id))

    @property
    def shard_views(self) -> tuple["Keys", ...]:
        """One view per shard, in shard order: what a worker or the audit writer reads."""
        return tuple(self.on(s) for s in range(max(self.shards, 1)))

    def _in_shard(self, name: str) -> str:
        if not self.shards:
            return f"{self.prefix}:{name}"
        if self.shard is None:
            raise ValueError(f"{name} is per shard: name it on a shard view (Keys.on)")
        return f"{{{shard_tag(self.prefix, self.shard, self.shards)}}}:{name}"

    def _of_request(self, name: str, request_id: str) -> str:
        if not self.shards:
            return f"{self.prefix}:{name}:{{{request_id}}}"
        tag = shard_tag(self.prefix, self.shard_of(request_id), self.shards)
        return f"{{{tag}}}:{name}:{request_id}"

    def _meta(self, name: str) -> str:
        return f"{{{self.prefix}}}:{name}" if self.shards else f"{self.prefix}:{name}"

    # Keys of each shard (name them on a view of one shard: ``on``)
    requests = _shard_key("requests", "Stream of jobs; consumer group ``workers``.")
    dead = _shard_key("dead", "Stream of dead-lettered jobs with their reason.")
    audit = _shard_key("audit", "Stream of final records for the audit writer; group ``audit``.")
    batch_requests = _shard_key(
        "requests:batch",
        "Stream of batch jobs (group ``workers``): a worker reads it only with capacity left "
        "after ``requests``, so batch files never starve interactive traffic.",
    )
    unread_ended = _shard_key(
        "unread-ended",
        "List: ids of requests a reader ended because their queue entry was removed before "
        "any worker read it (lifecycle/unread.py); workers take them to write their audit "
        "records (worker/unread_audit.py). Readers may only push to it.",
    )
    # The pool's own keys (the meta shard)
    adapters = _meta_key("adapters", "Hash: adapter name -> registry record.")
    adapter_ids = _meta_key(
        "adapter-ids", "Hash: adapter int id -> adapter name (keeps ids unique)."
    )
    model = _meta_key(
        "model", 'The pool\'s base model: {"name", "sha256"} of the first worker (SET NX).'
    )
    tokenizer = _meta_key(
        "tokenizer",
        "Hash: the base model's tokenizer for the gateway's /tokenize and /detokenize: "
        '``sha256`` (the model\'s) and ``record``, orjson {"sha256", "tokenizer" '
        '(tokenizer.json), "chat_template", "special", "clean_up_tokenization_spaces"}; '
        "written by each worker that starts.",
    )
    layout = _meta_key(
        "layout",
        "String: the key layout the pool's markers are in; '2' once a worker moved the "
        "run state of markers of the first layout to their run keys (lifecycle/run_state.py).",
    )
    lora_resolver = _meta_key(
        "lora-resolver", "String: 'off' while an admin has turned the gateways' LoRA resolver off."
    )
    workers = _meta_key("workers", "Hash: worker id -> heartbeat record.")
    consumer_sweep = _meta_key(
        "consumer-sweep",
        "String, expiring: the consumer of the worker whose turn it is to delete the "
        "consumers dead processes left in the groups (worker/consumers.py).",
    )
    api_keys = _meta_key(
        "api-keys",
        "Hash: API key id -> its record (tenant, role, sha256 of the key; never the key).",
    )
    webhook_secrets = _meta_key(
        "webhook-secrets",
        "Hash: tenant ('' for jobs without one) -> its webhook signing secrets (newest first).",
    )
    webhook_tenants = _meta_key(
        "webhook:tenants", "Set: tenants with webhook deliveries waiting or in flight."
    )
    webhook_dead = _meta_key(
        "webhook:dead", "Stream: webhook deliveries that never succeeded, with the reason."
    )
    webhook_stats = _meta_key(
        "webhook:stats", "Hash: counts of webhook attempts by outcome, and their total seconds."
    )
    audit_verify = _meta_key(
        "audit-verify",
        "Hash: audit verification jobs by id, 'latest:<mode>' and 'verified' "
        "(lifecycle/audit_verification.py; the gateway's).",
    )
    session_key = _meta_key(
        "session-key", "The key every gateway signs dashboard session tokens with (random)."
    )
    # The keys of one request (on its shard)
    callback = _request_key(
        "callback",
        "Set once a request's completion callback is in RQ (lorapool/batch/callbacks.py).",
    )
    job = _request_key(
        "job",
        "Hash: one job's submission (SUBMIT's idempotency marker: entry, submitted, "
        "priority, output_kind, on_finish). Producers may write it: nothing a worker "
        "writes or audits is read from it but the entry its first chunk checks.",
    )
    run = _request_key(
        "run",
        "Hash: one job's run, written by workers only (docs/redis-acl.md): the entry a "
        "worker took it from (``entry``), once it ended its ``status`` (finished, failed), "
        "final record (``result``) and, for a request a worker ended for its readers, "
        "when and why (``ended``, ``cause``; lifecycle/unread.py).",
    )
    response = _request_key(
        "response",
        "String: a stored Responses API response (orjson {response, conversation, "
        "input_items[, background]}) by its "
        "tenant's id; expires (gateway/responses_store.py).",
    )
    out = _request_key("out", "Chunk log (stream) and live channel (pub/sub) of one request.")
    abort = _request_key("abort", "Abort flag of one request, read by whichever worker holds it.")

    @property
    def pattern(self) -> str:
        """A SCAN pattern that matches every key of this pool (and only those)."""
        return f"{{{self.prefix}[:}}]*" if self.shards else f"{self.prefix}:*"

    @property
    def streams(self) -> tuple[str, ...]:
        """The job streams, in the order workers read them (``PRIORITIES``)."""
        return tuple(self.stream(p) for p in PRIORITIES)

    def stream(self, priority: str) -> str:
        """The stream of jobs of ``priority`` (one of ``PRIORITIES``)."""
        if priority == "interactive":
            return self.requests
        if priority == "batch":
            return self.batch_requests
        raise ValueError(f"priority must be one of {', '.join(PRIORITIES)}; got {priority!r}")

    def rate(self, tenant: str, what: str) -> str:
        """A tenant's rate state of ``what`` (requests, tokens): its GCRA theoretical
        arrival time (lorapool/lifecycle/rate_limits.py)."""
        return self._meta(f"rate:{tenant}:{what}")

    def session(self, token_sha256: str) -> str:
        """A dashboard session (its key id, expiry), by the sha256 of its token."""
        return self._meta(f"session:{token_sha256}")

    def webhook(self, delivery_id: str) -> str:
        """Hash: one webhook delivery (tenant, URL, body, attempts; batch/deliveries.py)."""
        return self._meta(f"webhook:{delivery_id}")

    def webhook_lane(self, tenant: str) -> str:
        """List: a tenant's webhook deliveries waiting for one of its delivery slots."""
        return self._meta(f"webhook-lane:{tenant}")

    def webhook_busy(self, tenant: str) -> str:
        """Sorted set: a tenant's deliveries in flight (in RQ or running), by lease end."""
        return self._meta(f"webhook-busy:{tenant}")

    def alive(self, worker: str) -> str:
        """A worker's liveness flag (``worker``: its consumer, ``name#incarnation``):
        expires a few heartbeats after its last one."""
        return self._meta(f"alive:{worker}")

    def handoff(self, worker: str) -> str:
        """List of entries other workers handed to ``worker`` (its consumer; adapter
        affinity): each
        "<stream's position in ``streams``, 1-based> <entry id>"."""
        return self._in_shard(f"handoff:{worker}")

    def batch(self, batch_id: str) -> str:
        """Hash: one batch file's state (status, counts, files; lorapool/batch/state.py)."""
        return self._pool_object("batch", batch_id)

    files = _meta_key(
        "files", "Sorted set: batch file id -> its expiry time (lorapool/batch/files.py)."
    )
    batches = _meta_key(
        "batches", "Sorted set: batch id -> its creation time (GET /v1/batches lists them)."
    )

    def file(self, file_id: str) -> str:
        """String: a batch file's OpenAI file object and owner (JSON); expires with it."""
        return self._pool_object("file", file_id)

    def file_data(self, file_id: str) -> str:
        """List: a batch file's bytes in blocks, in order; expires with the file."""
        return self._pool_object("file-data", file_id)

    def file_part(self, file_id: str) -> str:
        """List: the blocks of a file being written (renamed to ``file_data`` at its end)."""
        return self._pool_object("file-part", file_id)

    def _pool_object(self, name: str, object_id: str) -> str:
        """A key of one of the pool's objects (batch, file): on the meta shard when
        sharded (the files' index and every one of a file's keys share its slot)."""
        if self.shards:
            return self._meta(f"{name}:{object_id}")
        return f"{self.prefix}:{name}:{{{object_id}}}"
