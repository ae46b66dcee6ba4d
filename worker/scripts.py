"""Lua scripts of the worker: fenced chunk appends and fenced lease renewal.

Fencing: a worker writes for an entry only while XPENDING names it as the
entry's consumer. Another worker that claims the entry (XAUTOCLAIM) takes that
name away, so a paused worker that wakes up can neither append nor renew.
Chunk log entry ids are ``0-<seq + 1>``, and an append whose seq is not past
the log's last one is refused, so a log never holds a duplicate or a gap-filler
out of order.

Redis Cluster is not supported; use a standalone Redis (with replicas and
Sentinel for failover). Left as a documented limitation rather than
restructured: the atomicity the queue relies on spans keys of several hash
slots. Per-request keys (``{p}:job:{id}``, ``{p}:out:{id}``,
``{p}:abort:{id}``) share the slot of their ``{id}`` tag, but the shared
streams and hashes (``{p}:requests``, ``{p}:audit``, ``{p}:dead``,
``{p}:adapters``, ``{p}:adapter-ids``, ``{p}:workers``) each hash to a slot of
their own. A cluster refuses, with CROSSSLOT, these commands:

- ``APPEND`` touches ``{p}:requests`` (XPENDING, XACK, XDEL),
  the request's ``out``, ``abort`` and ``job`` keys, ``{p}:audit`` and
  ``{p}:dead``: the final chunk, the ack and the audit record must be one
  atomic step, so it cannot be split per slot without losing that guarantee;
- the producer's ``SUBMIT_SCRIPT`` (``producer/job.py``): ``{p}:job:{id}`` and
  ``{p}:requests`` (the idempotency marker and the entry together);
- the registry's WATCH/MULTI over ``{p}:adapters`` and ``{p}:adapter-ids``;
- ``renew``'s EXISTS and ``failover.abort_flagged``'s MGET over the abort
  flags of many requests (these could be split per slot; the first two not).

``RENEW`` (``{p}:requests`` only), XREADGROUP and XAUTOCLAIM are single-slot.
Making it work would mean one hash tag for every key of a pool (a prefix such
as ``{lorapool}``, which ``Keys`` refuses today): that puts the whole pool on
one shard, which is a standalone Redis in all but name.
"""

from lorapool.keys import WORKERS_GROUP, Keys


def append_call(
    keys: Keys,
    request_id: str,
    entry_id: str,
    consumer: str,
    *,
    seq: int,
    chunk: bytes,
    final: bool,
    audit: bytes,
    ttl_s: int,
    dead: bytes,
    reason: str,
    dead_max_len: int,
) -> dict:
    """The keys and args of one APPEND call (seq -1, request id "-": no chunk, only the
    ack and the dead letter)."""
    return {
        "keys": [
            keys.requests,
            keys.out(request_id),
            keys.abort(request_id),
            keys.job(request_id),
            keys.audit,
            keys.dead,
        ],
        "args": [WORKERS_GROUP, entry_id, consumer, seq, chunk, int(final), audit, ttl_s]
        + [dead, reason, dead_max_len],
    }


# KEYS: requests, out, abort, job, audit, dead
# ARGV: group, entry, consumer, seq (-1: no chunk), chunk, final (0/1), audit ('' none),
#       ttl, dead ('' none), reason, dead stream's MAXLEN (approximate)
# Returns -1 (not the owner), -2 (seq already in the log), else 1 if abort is asked, 0.
APPEND = """
local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[2], ARGV[2], 1)
if #p == 0 or p[1][2] ~= ARGV[3] then return -1 end
local seq = tonumber(ARGV[4])
if seq >= 0 then
  local last = redis.call('XREVRANGE', KEYS[2], '+', '-', 'COUNT', 1)
  if #last > 0 and tonumber(string.match(last[1][1], '-(%d+)$')) > seq then return -2 end
  redis.call('XADD', KEYS[2], '0-' .. (seq + 1), 'data', ARGV[5])
  redis.call('PUBLISH', KEYS[2], ARGV[5])
end
if ARGV[6] == '1' then
  redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
  redis.call('XDEL', KEYS[1], ARGV[2])
  if ARGV[7] ~= '' then redis.call('XADD', KEYS[5], '*', 'data', ARGV[7]) end
  if ARGV[9] ~= '' then
    redis.call('XADD', KEYS[6], 'MAXLEN', '~', ARGV[11], '*', 'data', ARGV[9],
               'reason', ARGV[10], 'entry', ARGV[2], 'worker', ARGV[3])
  end
  if seq >= 0 then
    redis.call('EXPIRE', KEYS[2], ARGV[8])
    redis.call('HSET', KEYS[4], 'status', ARGV[9] ~= '' and 'failed' or 'finished')
    redis.call('EXPIRE', KEYS[4], ARGV[8])
    redis.call('DEL', KEYS[3])
  end
  return 0
end
return redis.call('EXISTS', KEYS[3])
"""

# KEYS: requests. ARGV: group, consumer, idle_ms (0: renew), entry ids...
# Resets the idle time of the entries this consumer still owns; returns those it lost.
RENEW = """
local lost = {}
for i = 4, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if #p == 0 or p[1][2] ~= ARGV[2] then
    table.insert(lost, ARGV[i])
  else
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'IDLE', ARGV[3], 'JUSTID')
  end
end
return lost
"""
