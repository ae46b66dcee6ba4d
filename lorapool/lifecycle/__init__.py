"""A request's life on Redis, in one place: what producers, workers, the gateway, the
audit writer and every reader of streams do to Redis with the records of
``lorapool.records`` (the job, chunk, marker and run, dead letter, heartbeat, adapter
record: their fields and encodings live there, not here).

- ``keys``: every Redis key name, both layouts (one standalone Redis; shards on a Redis
  Cluster);
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
- ``run_state``: the move of the first layout's markers to run keys;
- ``rate_limits``: a tenant's request and token windows, as the gateway counts them.

Which room a change belongs in: a new field or status is ``records``; a new key, Lua
script or reader is here; the worker's policy (when to renew, claim, hand off,
dead-letter) stays in ``lorapool.worker``; what each of those does to Redis is here.

Torch-free. May import: the standard library, orjson, msgspec, ``lorapool.records`` and
lorapool's torch-free root modules; redis-py only in the modules that talk to Redis
(never ``keys``, which a producer's data types need alone). Never torch, SQLAlchemy, the
CLI, or the packages that use it (worker, producer, gateway, audit_db).
"""
