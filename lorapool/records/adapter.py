"""An adapter's identity: its registry record in ``{p}:adapters`` (name -> this record,
written by ``lorapool.producer.registry``), the same fields every audit record of a
request it ran carries (``audit_record.AdapterInfo`` is this class).

Decoded and checked here (``decode_adapter_record``: msgspec, every field's type),
compared with what a request names (``check_lora``) and turned into the
``LoRARequest`` a job carries. Producers check at submit and workers again at intake,
so both read it here (the worker never imports the producer).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import msgspec
import orjson

from lorapool.adapter_config import AdapterIdentity
from lorapool.records.errors import FieldError
from lorapool.records.params import LoRARequest

NAME_PATTERN = re.compile(r"[A-Za-z0-9._-]{1,128}")  # what the registry accepts as a name


class ModelIdentity(msgspec.Struct, frozen=True):
    """The base model a pool serves: its directory's name and the hex sha256 of its
    weights (``lorapool.identity.model_identity``). Workers claim the pool with it
    (``{p}:model``), name it in their heartbeats and metrics, and sign it into every
    audit record (``base_model``); its JSON is ``{"name": ..., "sha256": ...}``."""

    name: str
    sha256: str

    def to_dict(self) -> dict[str, str]:
        """As JSON has it (``{p}:model``, the job API's and the audit record's
        ``base_model``)."""
        return {"name": self.name, "sha256": self.sha256}


def decode_model_identity(raw: bytes | str | None) -> ModelIdentity | None:
    """The base model ``{p}:model`` holds (None: no worker has claimed the pool yet);
    ValueError when it holds no ``ModelIdentity``."""
    return _decode(raw, ModelIdentity, "base model record")


def _decode(raw: bytes | str | None, kind: type, what: str):
    """``raw`` decoded as a ``kind`` (None: nothing there); ValueError naming ``what``."""
    if raw is None:
        return None
    try:
        return msgspec.json.decode(raw, type=kind)
    except msgspec.DecodeError as exc:  # ValidationError too
        raise ValueError(f"malformed {what}: {exc}") from None


@dataclass(frozen=True)
class AdapterRecord:
    """The full identity of one adapter version: ``sha256`` of its weights file
    (``identity.adapter_sha256``), ``rank``, ``alpha``, ``target_modules`` and
    ``base_model`` from its ``adapter_config.json``, ``path`` resolved; ``config_sha256``
    of the config's math fields and ``digest`` of both files (``adapter_config``).

    A record written before config hashes has neither (None, left out of its JSON, so
    that it reads and writes back byte for byte): a worker then checks the config's
    rank, alpha and targets, and records the hashes of what it loaded."""

    name: str
    id: int
    path: str
    sha256: str
    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    base_model: str | None = field(default=None, kw_only=True)
    config_sha256: str | None = field(default=None, kw_only=True)
    digest: str | None = field(default=None, kw_only=True)

    def to_dict(self) -> dict[str, Any]:
        """As JSON has it (the registry's, the admin API's, the audit record's ``adapter``);
        the hashes only when known."""
        data = {**asdict(self), "target_modules": list(self.target_modules)}
        for name in HASHES:
            if data[name] is None:
                del data[name]
        return data

    def as_loaded(self, loaded: AdapterIdentity) -> AdapterRecord:
        """This record with what a worker loaded for it: hashes, rank, alpha, targets."""
        return replace(
            self,
            sha256=loaded.sha256,
            rank=loaded.rank,
            alpha=loaded.alpha,
            target_modules=loaded.target_modules,
            config_sha256=loaded.config_sha256,
            digest=loaded.digest,
        )


HASHES = ("config_sha256", "digest")  # fields a record written before them lacks


def adapter_record(name: str, adapter_id: int, info: dict[str, Any]) -> AdapterRecord:
    """The record of adapter ``name`` with id ``adapter_id`` and ``info`` (the rest of
    the fields, ``producer.registry.describe_adapter``); ValueError naming a bad field."""
    try:
        return msgspec.convert({"name": name, "id": adapter_id, **info}, AdapterRecord)
    except msgspec.ValidationError as exc:
        raise ValueError(f"adapter {name!r}: {exc}") from None


def encode_adapter_record(record: AdapterRecord) -> bytes:
    return orjson.dumps(record.to_dict())


def decode_adapter_record(raw: bytes | str | None) -> AdapterRecord | None:
    """The record ``raw`` holds (None: no record); ValueError when it holds none."""
    return _decode(raw, AdapterRecord, "adapter record")


class UnknownAdapter(ValueError):
    """The registry holds no adapter of the name a request gives (``name``)."""

    field = "adapter"  # what it refuses, as a FieldError's path says it

    def __init__(self, name: str):
        super().__init__(
            f"unknown adapter {name!r}: register it with `lorapool adapters add {name} PATH`"
        )
        self.name = name


def lora_from_record(record: AdapterRecord) -> LoRARequest:
    return LoRARequest(record.name, record.id, record.path, record.base_model)


def requested_name(requested: LoRARequest | str) -> str:
    """The registry name a request gives. One no adapter can have is UnknownAdapter at
    once, without a look-up (a lone surrogate in a name built in Python could not even
    be sent to Redis)."""
    name = requested if isinstance(requested, str) else requested.lora_name
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise UnknownAdapter(name)
    return name


def check_lora(requested: LoRARequest | str, record: AdapterRecord | None) -> LoRARequest:
    """The LoRARequest to enqueue for ``requested`` given its registry record (or None).

    Raises UnknownAdapter (a ValueError) when the adapter is unknown, FieldError (path
    ``adapter``) when its id or path collides.
    """
    name = requested if isinstance(requested, str) else requested.lora_name
    if record is None:
        raise UnknownAdapter(name)
    if isinstance(requested, LoRARequest):
        if requested.lora_int_id != record.id:
            raise FieldError(
                f"adapter {name!r} has id {record.id} in the registry, "
                f"not {requested.lora_int_id} (colliding adapter id)",
                field="adapter",
            )
        if requested.lora_path and str(Path(requested.lora_path).resolve()) != record.path:
            raise FieldError(
                f"adapter {name!r} is registered with path {record.path}, "
                f"not {requested.lora_path}",
                field="adapter",
            )
    return lora_from_record(record)
