"""A request's life on Redis, in one place: what producers, workers, the gateway, the
audit writer and every reader of streams share.

- ``keys``: every Redis key name, both layouts (one standalone Redis; shards on a Redis
  Cluster);
- ``wire``: the records on the queue (jobs) and on the chunk logs (chunks).

Torch-free. May import: the standard library, orjson and lorapool's torch-free data
types (``protocol``, ``outputs``, ``messages``); redis-py only in the modules that talk
to Redis (never ``keys`` and ``wire``, which a producer's data types need alone). Never
torch, SQLAlchemy, the CLI, or the packages that use it (worker, producer, gateway,
audit_db).
"""
