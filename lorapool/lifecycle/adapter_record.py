"""An adapter's registry record as the pool reads it from ``{p}:adapters`` (written by
``lorapool.producer.registry``): decoded, checked against what a request names, and
turned into the ``LoRARequest`` a job carries. Producers check at submit and workers
again at intake, so both read it here (the worker never imports the producer)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson

from lorapool.protocol import LoRARequest


class UnknownAdapter(ValueError):
    """The registry holds no adapter of the name a request gives (``name``)."""

    def __init__(self, name: str):
        super().__init__(
            f"unknown adapter {name!r}: register it with `lorapool adapters add {name} PATH`"
        )
        self.name = name


def lora_from_record(record: dict[str, Any]) -> LoRARequest:
    return LoRARequest(record["name"], int(record["id"]), record["path"], record.get("base_model"))


def check_lora(requested: LoRARequest | str, record: dict[str, Any] | None) -> LoRARequest:
    """The LoRARequest to enqueue for ``requested`` given its registry record (or None).

    Raises UnknownAdapter (a ValueError) when the adapter is unknown, ValueError when
    its id or path collides.
    """
    name = requested if isinstance(requested, str) else requested.lora_name
    if record is None:
        raise UnknownAdapter(name)
    if isinstance(requested, LoRARequest):
        if requested.lora_int_id != record["id"]:
            raise ValueError(
                f"adapter {name!r} has id {record['id']} in the registry, "
                f"not {requested.lora_int_id} (colliding adapter id)"
            )
        if requested.lora_path and str(Path(requested.lora_path).resolve()) != record["path"]:
            raise ValueError(
                f"adapter {name!r} is registered with path {record['path']}, "
                f"not {requested.lora_path}"
            )
    return lora_from_record(record)


def decode_adapter_record(raw: bytes | str | None) -> dict[str, Any] | None:
    return None if raw is None else orjson.loads(raw)
