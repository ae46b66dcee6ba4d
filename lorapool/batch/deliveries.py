"""Webhook deliveries that one tenant cannot stall: a lane per tenant, a few slots each.

A delivery (``{p}:webhook:<id>``: tenant, URL, the exact body, attempts) waits in its
tenant's lane (``{p}:webhook-lane:<tenant>``) until the tenant has fewer than
``tenant_concurrency`` deliveries in flight (``{p}:webhook-busy:<tenant>``, each with
a lease); only then is it enqueued as an RQ job (JSON, never pickle). So a tenant whose
receiver hangs holds at most that many RQ workers, each for at most the egress deadline;
the other tenants' deliveries pass it in the RQ queue. An attempt goes through
``lorapool.egress`` (public addresses only unless allow-listed, no redirects, a
whole-request deadline) signed as Standard Webhooks says (``webhook_secrets``).

A failed attempt frees its slot and is retried after an exponential backoff with
jitter (RQ's scheduler: run the RQ workers ``--with-scheduler``), at most
``max_attempts`` times; then, or at once for a URL the policy refuses, the delivery
goes to the dead letter ``{p}:webhook:dead`` with the reason. Counts and seconds by
outcome go to ``{p}:webhook:stats`` (``/metrics``: ``lorapool_webhook_*``). A lease
that ends (an RQ worker killed mid-attempt) puts its delivery back at the head of its
lane the next time the lane is pumped (every dispatch and every finished attempt).
Deliveries are at least once: receivers deduplicate on ``webhook-id``.
"""

from __future__ import annotations

import contextlib
import logging
import random
import time
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any

import redis
from rq import Queue, get_current_job
from rq.exceptions import DuplicateJobError
from rq.serializers import JSONSerializer

from lorapool import egress
from lorapool.batch.webhook_secrets import WebhookSecrets, signed_headers
from lorapool.config_fields import AtLeast1, OptionError, Wait, check_fields
from lorapool.connection import register_script
from lorapool.lifecycle.keys import DEAD_MAX_LEN, DEFAULT_PREFIX, Keys

logger = logging.getLogger(__name__)
DEFAULT_QUEUE = "lorapool-callbacks"
RECORD_TTL_S = 7 * 24 * 3600
REASON_CHARS = 300


@dataclass
class WebhookConfig:
    """How a pool delivers webhooks; travels with each RQ job as JSON.

    allow: the egress allow-list (``--webhook-allow``). deadline_s: one attempt's whole
    bound. max_attempts: attempts before the dead letter. backoff_s, backoff_cap_s: the
    wait after attempt k is backoff_s * 2**(k-1), at most the cap, times a random factor
    in [0.5, 1). tenant_concurrency: a tenant's deliveries in flight at most.
    """

    prefix: str = DEFAULT_PREFIX
    shards: int = 0
    queue: str = DEFAULT_QUEUE
    allow: tuple[str, ...] = ()
    deadline_s: float = egress.DEFAULT_DEADLINE_S  # these two: EgressPolicy checks them
    max_response_bytes: int = egress.DEFAULT_MAX_RESPONSE_BYTES
    max_attempts: AtLeast1 = 8
    backoff_s: Wait = 2.0
    backoff_cap_s: Wait = 600.0
    tenant_concurrency: AtLeast1 = 2
    policy: egress.EgressPolicy = field(init=False, repr=False)

    def __post_init__(self):
        self.allow = tuple(self.allow)  # a list when read back from the RQ job's JSON
        check_fields(self)
        self.policy = egress.EgressPolicy(self.allow, self.deadline_s, self.max_response_bytes)
        if self.backoff_s > self.backoff_cap_s:
            raise OptionError(
                "backoff_s",
                f"backoff_s ({self.backoff_s}) must be at most "
                f"backoff_cap_s ({self.backoff_cap_s})",
            )

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("policy")
        return data

    @property
    def keys(self) -> Keys:
        return Keys(self.prefix, self.shards)

    @property
    def lease_s(self) -> float:
        """How long a slot is held without news: the wait in RQ and one attempt."""
        return max(60.0, 3 * self.deadline_s)

    def backoff(self, attempt: int) -> float:
        wait = min(self.backoff_cap_s, self.backoff_s * 2 ** (attempt - 1))
        return wait * random.uniform(0.5, 1.0)


# Add a delivery to its tenant's lane, unless it exists (a second dispatch of the same
# request). KEYS: the delivery's hash, the lane, the tenants set. ARGV: tenant, url,
# body, created, the record's TTL, the delivery's id. Returns 1 when added.
PUSH_SCRIPT = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], 'tenant', ARGV[1], 'url', ARGV[2], 'body', ARGV[3],
           'created', ARGV[4], 'attempts', 0)
redis.call('EXPIRE', KEYS[1], ARGV[5])
redis.call('RPUSH', KEYS[2], ARGV[6])
redis.call('SADD', KEYS[3], ARGV[1])
return 1
"""

# Take a tenant's next deliveries while it has free slots: deliveries whose lease ended
# go back to the lane's head first. KEYS: lane, busy set, tenants set. ARGV: tenant,
# slots, lease seconds. Returns the ids taken (each now holds a slot).
TAKE_SCRIPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local ended = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now)
for i = #ended, 1, -1 do
  redis.call('ZREM', KEYS[2], ended[i])
  redis.call('LPUSH', KEYS[1], ended[i])
end
local free = tonumber(ARGV[2]) - redis.call('ZCARD', KEYS[2])
local taken = {}
while free > 0 do
  local id = redis.call('LPOP', KEYS[1])
  if not id then break end
  redis.call('ZADD', KEYS[2], now + tonumber(ARGV[3]), id)
  taken[#taken + 1] = id
  free = free - 1
end
if redis.call('LLEN', KEYS[1]) == 0 and redis.call('ZCARD', KEYS[2]) == 0 then
  redis.call('SREM', KEYS[3], ARGV[1])
end
return taken
"""


def delivery_id(prefix: str, request_id: str) -> str:
    """The webhook-id of a request's delivery: the same for every dispatch and retry."""
    import hashlib

    return "msg_" + hashlib.sha256(f"{prefix}\0{request_id}".encode()).hexdigest()[:36]


class Lanes:
    """The tenants' lanes of one pool (a synchronous client)."""

    def __init__(self, connection: redis.Redis, config: WebhookConfig):
        self.redis, self.config, self.keys = connection, config, config.keys
        self._push = register_script(connection, PUSH_SCRIPT)
        self._take = register_script(connection, TAKE_SCRIPT)
        self.queue = Queue(config.queue, connection=connection, serializer=JSONSerializer)

    def push(self, delivery: str, tenant: str, url: str, body: bytes) -> bool:
        """Queue a delivery in its tenant's lane and pump the lane; False if it exists."""
        keys = [self.keys.webhook(delivery), self.keys.webhook_lane(tenant)]
        args = [tenant, url, body, time.time(), RECORD_TTL_S, delivery]
        added = bool(self._push(keys=[*keys, self.keys.webhook_tenants], args=args))
        self.pump(tenant)
        return added

    def pump(self, tenant: str) -> int:
        """Enqueue in RQ the tenant's deliveries that its free slots allow; how many."""
        keys = [self.keys.webhook_lane(tenant), self.keys.webhook_busy(tenant)]
        args = [tenant, self.config.tenant_concurrency, self.config.lease_s]
        taken = self._take(keys=[*keys, self.keys.webhook_tenants], args=args)
        for raw in taken:
            self._enqueue(raw.decode())
        return len(taken)

    def pump_all(self) -> int:
        """Pump every lane with deliveries waiting or in flight (ended leases come back)."""
        tenants = self.redis.smembers(self.keys.webhook_tenants)
        return sum(self.pump(t.decode()) for t in tenants)

    def _enqueue(self, delivery: str) -> None:
        attempts = int(self.redis.hget(self.keys.webhook(delivery), "attempts") or 0)
        # DuplicateJobError: this attempt is in RQ already (a lease ended while it waited)
        with contextlib.suppress(DuplicateJobError):
            self.queue.enqueue(
                "lorapool.batch.deliveries.deliver", delivery, self.config.to_dict(),
                job_id=f"lorapool-wh-{delivery[4:]}-{attempts}", unique=True,
                job_timeout=int(self.config.deadline_s) + 30, result_ttl=600, failure_ttl=86400,
            )  # fmt: skip

    def release(self, tenant: str, delivery: str) -> None:
        self.redis.zrem(self.keys.webhook_busy(tenant), delivery)

    def renew(self, tenant: str, delivery: str) -> None:
        until = time.time() + self.config.deadline_s + 30
        self.redis.zadd(self.keys.webhook_busy(tenant), {delivery: until}, xx=True)

    def count(self, outcome: str, seconds: float) -> None:
        with self.redis.pipeline(transaction=False) as pipe:
            pipe.hincrby(self.keys.webhook_stats, outcome, 1)
            pipe.hincrbyfloat(self.keys.webhook_stats, f"{outcome}_seconds", seconds)
            pipe.execute()

    def dead(self, delivery: str, record: dict[str, str], reason: str) -> None:
        """Into the dead letter with the reason; the delivery is done."""
        fields = {
            "id": delivery,
            "tenant": record["tenant"],
            "url": record["url"],
            "attempts": record["attempts"],
            "reason": reason[:REASON_CHARS],
        }
        with self.redis.pipeline(transaction=False) as pipe:
            pipe.xadd(self.keys.webhook_dead, fields, maxlen=DEAD_MAX_LEN, approximate=True)
            pipe.hincrby(self.keys.webhook_stats, "dead", 1)
            pipe.delete(self.keys.webhook(delivery))
            pipe.execute()


def _record(connection: redis.Redis, keys: Keys, delivery: str) -> dict[str, str] | None:
    raw = connection.hgetall(keys.webhook(delivery))
    if not raw:
        return None
    return {k.decode(): v.decode("utf-8", "surrogateescape") for k, v in raw.items()}


def deliver(delivery: str, raw_config: dict[str, Any]) -> str:
    """RQ job: one attempt of ``delivery``; then its next step (done, retry, dead)."""
    connection = get_current_job().connection
    config = WebhookConfig(**raw_config)
    lanes = Lanes(connection, config)
    record = _record(connection, config.keys, delivery)
    if record is None:
        return "gone"  # delivered or dead-lettered already (a lease ended meanwhile)
    tenant = record["tenant"]
    lanes.renew(tenant, delivery)
    try:
        return _attempt(lanes, delivery, record)
    finally:
        lanes.release(tenant, delivery)
        lanes.pump(tenant)


def _attempt(lanes: Lanes, delivery: str, record: dict[str, str]) -> str:
    config, keys = lanes.config, lanes.keys
    attempts = int(record["attempts"]) + 1
    lanes.redis.hset(keys.webhook(delivery), "attempts", attempts)
    record["attempts"] = str(attempts)
    body = record["body"].encode("utf-8", "surrogateescape")
    secrets = WebhookSecrets(lanes.redis, keys).valid(record["tenant"])
    start = time.monotonic()
    if not secrets:
        reason = f"no webhook secret for tenant {record['tenant']!r} (lorapool keys webhook-secret)"
        lanes.dead(delivery, record, reason)
        return "dead"
    try:
        headers = signed_headers(secrets, delivery, body)
        response = egress.request("POST", record["url"], body, headers, config.policy)
    except egress.EgressRefused as exc:
        lanes.count("refused", time.monotonic() - start)
        lanes.dead(delivery, record, str(exc))
        return "dead"
    except egress.EgressError as exc:
        reason = str(exc)
    else:
        if response.ok:
            lanes.count("delivered", time.monotonic() - start)
            lanes.redis.delete(keys.webhook(delivery))
            return "delivered"
        reason = f"HTTP {response.status}"
        if 300 <= response.status < 400:
            reason += " (redirects are not followed)"
    lanes.count("failed", time.monotonic() - start)
    if attempts >= config.max_attempts:
        lanes.dead(delivery, record, f"{attempts} attempts; the last: {reason}")
        return "dead"
    wait = config.backoff(attempts)
    logger.info(
        "webhook %s: attempt %d failed (%s); next in %.1fs", delivery, attempts, reason, wait
    )
    lanes.queue.enqueue_in(
        timedelta(seconds=wait), "lorapool.batch.deliveries.requeue", delivery, config.to_dict(),
        job_id=f"lorapool-wr-{delivery[4:]}-{attempts}", result_ttl=600,
    )  # fmt: skip
    return "retry"


def requeue(delivery: str, raw_config: dict[str, Any]) -> str:
    """RQ job (scheduled after a backoff): the delivery back at its lane's tail."""
    connection = get_current_job().connection
    config = WebhookConfig(**raw_config)
    keys, lanes = config.keys, Lanes(connection, config)
    tenant = connection.hget(keys.webhook(delivery), "tenant")
    if tenant is None:
        return "gone"
    tenant = tenant.decode()
    with connection.pipeline(transaction=False) as pipe:
        pipe.rpush(keys.webhook_lane(tenant), delivery)
        pipe.sadd(keys.webhook_tenants, tenant)
        pipe.execute()
    lanes.pump(tenant)
    return "queued"
