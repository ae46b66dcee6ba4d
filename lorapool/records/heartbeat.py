"""A worker's heartbeat: its record in ``{p}:workers`` (consumer -> this record), written
every ``heartbeat_s`` beside its liveness flag ``{p}:alive:{consumer}`` (``worker/pool.py``).
The consumer is the process's (``name#incarnation``, ``worker/state.py``): two
processes started with one ``--name`` are two records, each showing that name.

Read by the worker's peers (fair share, adapter hand-off: ``worker/intake.py``), the
gateway (the bounds it checks at the door: ``openai/limits.py``; readiness; the
dashboard) and ``lorapool status``, all through ``decode_heartbeats``. Every field but
the name may be missing (None, or empty): a record of an older worker, or of an engine
that does not say its bounds, still reads; one that is not a heartbeat at all (the hash
is writable by producers) is left out. Torch-free.
"""

from __future__ import annotations

import msgspec


class Heartbeat(msgspec.Struct, kw_only=True):
    """What a worker says of itself. ``updated``: ``time.time()`` of the record;
    ``adapters``: those of the requests it holds; ``loaded``: those in its device slots;
    the engine's bounds (``EngineInterface.request_limits``) and KV cache usage last."""

    name: str
    # the process's consumer in the group (``name#incarnation``; None: an older worker,
    # whose consumer was its name): the field and alive key of its record
    consumer: str | None = None
    device: str | None = None
    model: str | None = None  # the base model's name
    updated: float | None = None
    running: int | None = None
    waiting: int | None = None
    held: int | None = None
    tokens_per_s: float | None = None
    adapters: list[str] = []
    loaded: list[str] = []
    draining: bool = False
    max_model_len: int | None = None
    max_logprobs: int | None = None
    kv_capacity_tokens: int | None = None
    kv_cache_usage: float | None = None

    def to_dict(self) -> dict:
        return msgspec.structs.asdict(self)


def consumer_of(heartbeat: Heartbeat) -> str:
    """The worker's consumer in the ``workers`` group (an older worker's: its name)."""
    return heartbeat.consumer or heartbeat.name


def encode_heartbeat(heartbeat: Heartbeat) -> bytes:
    return msgspec.json.encode(heartbeat)


_decoder = msgspec.json.Decoder(Heartbeat)


def decode_heartbeat(raw: bytes | str) -> Heartbeat:
    """The heartbeat ``raw`` holds; ValueError when it holds none."""
    try:
        return _decoder.decode(raw)
    except msgspec.DecodeError as exc:  # ValidationError too
        raise ValueError(f"malformed heartbeat: {exc}") from None


def decode_heartbeats(records: dict[bytes, bytes]) -> dict[str, Heartbeat]:
    """The heartbeats ``{p}:workers`` holds (``records``: as HGETALL gives it), by worker
    name in order, leaving out those that are not heartbeats."""
    found = {}
    for name in sorted(records):
        try:
            found[name.decode()] = decode_heartbeat(records[name])
        except (UnicodeDecodeError, ValueError):
            continue
    return found
