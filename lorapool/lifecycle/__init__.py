"""A request's life on Redis, in one place: what producers, workers, the gateway, the
audit writer and every reader of streams share.

- ``keys``: every Redis key name, both layouts (one standalone Redis; shards on a Redis
  Cluster);
- ``wire``: the records on the queue (jobs);
- ``chunk``: a chunk of a request's log and its per-completion ``Delta``, typed, with
  its encode and decode;
- ``error_kind``: what failed a request, carried in its final chunk, read by readers;
- ``dead_letter``: an entry given up on (``{p}:dead``), as both its writers write it;
- ``heartbeat``: a worker's record in ``{p}:workers``, as its peers, the gateway and
  ``lorapool status`` read it;
- ``adapter_record``: an adapter's registry record as producers and workers read it;
- each Lua script of a request's life with its one typed wrapper, which writes the
  script's KEYS/ARGV out once: ``submit`` (SUBMIT, and the job it enqueues), ``intake``
  (READ, HANDOFF), ``append`` (APPEND: fenced chunks, and at the end the final record,
  ack, audit record and dead letter), ``lease`` (RENEW, with claiming an idle entry and
  reading its log to resume), ``queue_position``;
- ``marker``: what a client does to a request it submitted (abort, read back);
- the readers: ``chunk_log`` (a request's log, a list with a chunk at index seq; a
  reader's place in it; the final record a finished log is compacted into; the
  assembler of outputs), ``follower`` (many requests followed on one asyncio
  connection: live channel, gaps filled from the log) and ``listener`` (one request's
  live channel on a sync client, for a single ``JobHandle``);
- ``accumulator``: a request's output kept from its chunks, O(a chunk) each: what the
  worker compacts a finished log into, and what readers' cumulative outputs come from.

The worker's policy (when to renew, claim, hand off, dead-letter) stays in
``lorapool.worker``; what each of those does to Redis is here.

Torch-free. May import: the standard library, orjson, msgspec (the typed records:
``chunk``, ``dead_letter``, ``adapter_record``, ``heartbeat``) and lorapool's torch-free
data types (``protocol``, ``outputs``, ``messages``); redis-py only in the modules that talk to
Redis (never ``keys`` and ``wire``, which a producer's data types need alone). Never
torch, SQLAlchemy, the CLI, or the packages that use it (worker, producer, gateway,
audit_db).
"""
