"""The adapter registry in Redis: name -> id, path, sha256, rank, alpha, targets,
config sha256 and digest.

``{p}:adapters`` maps a name to its record (``records.adapter``);
``{p}:adapter-ids`` maps an int id to its name, which keeps ids unique. Torch-free:
the sha256 is taken over the bytes of ``adapter_model.safetensors``, the config's over
the math fields of ``adapter_config.json`` (``lorapool.adapter_config``), the rest is
read from that config.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import msgspec
import redis

from lorapool.adapter_config import CONFIG_FILE, changes, identity_of, parse_config
from lorapool.connection import client_for
from lorapool.identity import ADAPTER_WEIGHTS, adapter_sha256
from lorapool.lifecycle.keys import Keys
from lorapool.protocol import LoRARequest, short_repr
from lorapool.records.adapter import (  # the worker reads the records too
    NAME_PATTERN,
    AdapterRecord,
    adapter_record,
    check_lora,
    decode_adapter_record,
    encode_adapter_record,
    lora_from_record,
    requested_name,
)
from lorapool.records.bounds import AdapterId, explain

WEIGHTS_FILE = ADAPTER_WEIGHTS
ROOTS_ENV = "LORAPOOL_ADAPTER_ROOTS"  # directories, separated by os.pathsep


class NameRefused(ValueError):
    """The registry refused an adapter for its name: not a valid name, or one registered
    with another id or other weights (the gateway's 400 names ``lora_name``)."""


def roots_from_env() -> list[str]:
    return [r for r in os.environ.get(ROOTS_ENV, "").split(os.pathsep) if r]


def check_name(name: Any) -> str:
    """An adapter name: 1 to 128 of ``A-Z a-z 0-9 . _ -``; ValueError otherwise."""
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise NameRefused(
            f"adapter name {short_repr(name)} is not 1 to 128 characters of "
            "letters, digits, '.', '_' and '-'"
        )
    return name


def check_inside_roots(path: str | Path, roots: list[str]) -> Path:
    """The real path of ``path`` (symlinks and '..' resolved), refused outside ``roots``."""
    real = Path(path).expanduser().resolve()
    if roots:
        resolved = [Path(r).expanduser().resolve() for r in roots]
        if not any(real == root or root in real.parents for root in resolved):
            raise ValueError(
                f"adapter path {path} (really {real}) is outside the adapter roots "
                f"{', '.join(map(str, resolved))}"
            )
    return real


def describe_adapter(path: str | Path) -> dict[str, Any]:
    """Read an adapter folder: sha256 of its weights, rank, alpha, targets (PEFT's
    defaults where the config leaves them out, as the engine's loader reads it), base
    model, config sha256 and digest (an ``AdapterRecord``'s fields but its name and id)."""
    path = Path(path)
    weights = path / WEIGHTS_FILE
    if not weights.is_file():
        raise ValueError(f"adapter folder {path} has no {WEIGHTS_FILE}")
    config = {}
    if (path / CONFIG_FILE).is_file():
        try:
            config = parse_config((path / CONFIG_FILE).read_bytes())
        except ValueError as exc:
            raise ValueError(f"adapter folder {path}: {exc}") from None
    identity = identity_of(config, adapter_sha256(path))
    return {
        "path": str(path.resolve()),
        "sha256": identity.sha256,
        "rank": identity.rank,
        "alpha": identity.alpha,
        "target_modules": list(identity.target_modules),
        "base_model": config.get("base_model_name_or_path"),
        "config_sha256": identity.config_sha256,
        "digest": identity.digest,
    }


class AdapterRegistry:
    """Adapters known to the pool (synchronous; the async producer reads the same keys)."""

    def __init__(self, connection: redis.Redis, keys: Keys, roots: list[str] | None = None):
        """``roots``: register only adapters inside these directories (default:
        ``$LORAPOOL_ADAPTER_ROOTS``; none given, any directory)."""
        self.redis = connection
        self.keys = keys
        self.roots = roots_from_env() if roots is None else list(roots)

    def get(self, name: str) -> AdapterRecord | None:
        return decode_adapter_record(self.redis.hget(self.keys.adapters, name))

    def list(self) -> list[AdapterRecord]:
        records = [decode_adapter_record(v) for v in self.redis.hvals(self.keys.adapters)]
        return sorted(records, key=lambda r: r.id)

    def resolve(self, requested: LoRARequest | AdapterRecord | str | None) -> LoRARequest | None:
        """The registered LoRARequest for a name or LoRARequest; ValueError if unknown.
        A record just read is taken as it is (``AsyncProducer.resolve``)."""
        if requested is None:
            return None
        if isinstance(requested, AdapterRecord):
            return lora_from_record(requested)
        return check_lora(requested, self.get(requested_name(requested)))

    def add(
        self,
        name: str,
        path: str | Path,
        adapter_id: int | None = None,
        info: dict[str, Any] | None = None,
    ) -> AdapterRecord:
        """Register an adapter; idempotent for the same name, id, path and weights.

        Refuses (ValueError) a name registered with other weights, path or id,
        an id that another adapter holds, a name outside ``[A-Za-z0-9._-]{1,128}``
        and a path (after symlinks) outside the registry's roots.
        """
        check_name(name)
        path = check_inside_roots(path, self.roots)
        info = info if info is not None else describe_adapter(path)
        if adapter_id is not None:
            try:  # the bound lora_request.lora_int_id has (lorapool.records.bounds)
                msgspec.convert(adapter_id, AdapterId, strict=True)
            except msgspec.ValidationError:
                raise ValueError(
                    f"adapter id must be {explain(AdapterId)}, got {short_repr(adapter_id)}"
                ) from None
        # the registry's two hashes share the meta shard's slot (its node, on a cluster)
        with client_for(self.redis, self.keys.adapters).pipeline() as pipe:
            while True:
                try:
                    return self._add_once(pipe, name, adapter_id, info)
                except redis.WatchError:
                    continue

    def _add_once(self, pipe, name: str, adapter_id: int | None, info: dict) -> AdapterRecord:
        pipe.watch(self.keys.adapters, self.keys.adapter_ids)
        existing = decode_adapter_record(pipe.hget(self.keys.adapters, name))
        if existing is not None:
            same = _same_or_refuse(existing, adapter_id, info)
            if same.digest is not None or info.get("digest") is None:
                pipe.unwatch()
                return same
            # a record written before config hashes, of these very files: pinned now
            record = adapter_record(name, existing.id, info)
            pipe.multi()
            pipe.hset(self.keys.adapters, name, encode_adapter_record(record))
            pipe.execute()
            return record
        ids = {int(i): n.decode() for i, n in pipe.hgetall(self.keys.adapter_ids).items()}
        new_id = adapter_id if adapter_id is not None else max(ids, default=0) + 1
        if new_id in ids:
            pipe.unwatch()
            raise ValueError(f"adapter id {new_id} is already used by adapter {ids[new_id]!r}")
        record = adapter_record(name, new_id, info)
        pipe.multi()
        pipe.hset(self.keys.adapters, name, encode_adapter_record(record))
        pipe.hset(self.keys.adapter_ids, new_id, name)
        pipe.execute()
        return record

    def remove(self, name: str) -> bool:
        record = self.get(name)
        if record is None:
            return False
        with client_for(self.redis, self.keys.adapters).pipeline() as pipe:
            pipe.hdel(self.keys.adapters, name)
            pipe.hdel(self.keys.adapter_ids, record.id)
            pipe.execute()
        return True


def _same_or_refuse(existing: AdapterRecord, adapter_id: int | None, info: dict) -> AdapterRecord:
    name = existing.name
    if adapter_id is not None and adapter_id != existing.id:
        raise NameRefused(f"adapter {name!r} is already registered with id {existing.id}")
    if (existing.path, existing.sha256) != (info["path"], info["sha256"]):
        raise NameRefused(
            f"adapter {name!r} is already registered with other weights "
            f"({existing.path}, sha256 {existing.sha256[:12]}); remove it "
            f"first or register the new version under a new name"
        )
    if info.get("digest") is not None and existing.digest not in (None, info["digest"]):
        raise NameRefused(
            f"adapter {name!r} is already registered with another {CONFIG_FILE} "
            f"(digest {existing.digest[:12]}, now {info['digest'][:12]}); remove it "
            f"first or register the new version under a new name"
        )
    if existing.digest is None and info.get("digest") is not None:
        changed = changes(existing, adapter_record(name, existing.id, info))
        if changed:
            raise NameRefused(
                f"adapter {name!r} is already registered with other files: "
                + "; ".join(changed)
                + "; remove it first or register the new version under a new name"
            )
    return existing
