"""An adapter is all of its files (issue 48 row D): ``lora_alpha`` edited 16 -> 1600 in a
registered adapter's ``adapter_config.json`` is refused like swapped weights (final
error chunk, audit record, dead letter), and an audit row's rank, alpha, targets and
hashes are those of the files the worker loaded.

Real Redis, the real worker loop, the audit writer into SQLite and PostgreSQL. The
oracles: PEFT's own ``LoraConfig.from_pretrained`` for rank, alpha and targets,
hashlib over the weights file, and the engine's record of what it loaded.
"""

import hashlib
import json
from pathlib import Path

import orjson
import pool_layout
import pytest
from adapters import build_adapter
from audit_fixtures import KEY

from lorapool.adapter_config import identity_of
from lorapool.audit_db import AuditWriter, WriterConfig, verify_chain
from lorapool.audit_db.queries import get_request
from lorapool.protocol import SamplingParams
from lorapool.records.dead_letter import decode_dead_letter
from lorapool.worker import Worker, WorkerConfig
from lorapool.worker.serve import base_model_info

pytest_plugins = ["audit_fixtures"]
pytestmark = pytest.mark.integration
LAYOUTS = ("standalone",)
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def fresh_engine(model):
    """A worker's engine with nothing loaded yet."""
    from lorapool.engine.config import EngineArgs
    from lorapool.engine.llm_engine import LLMEngine

    args = EngineArgs(model=model, enable_lora=True, max_loras=2, max_lora_rank=8, max_num_seqs=8)
    return LLMEngine.from_engine_args(args)


def run_pool(engine, conn, keys, model, audit_target) -> None:
    """Run a burst worker, then a burst audit writer into ``audit_target``."""
    config = WorkerConfig(prefix=keys.prefix, shards=keys.shards, burst=True)
    Worker(engine, conn, config, base_model_info(model)).run()
    writer = WriterConfig(prefix=keys.prefix, shards=keys.shards)
    AuditWriter(conn, audit_target.engine, writer).run(burst=True)


def edit_config(path: Path, **changes) -> None:
    file = path / "adapter_config.json"
    file.write_text(json.dumps({**json.loads(file.read_text()), **changes}))


def peft_config(path: Path):
    from peft import LoraConfig

    return LoraConfig.from_pretrained(str(path))


def test_an_edited_lora_alpha_is_refused_like_swapped_weights(
    audit_target, model, conn, keys, producer, tmp_path
):
    adapter = build_adapter(model, tmp_path / "ad", rank=8, alpha=16, seed=4)
    registered = producer.registry.add("ad", adapter, adapter_id=11)
    edit_config(adapter, lora_alpha=1600)  # row D: the weights file is untouched
    assert hashlib.sha256((adapter / "adapter_model.safetensors").read_bytes()).hexdigest() == (
        registered.sha256
    )
    edited = producer.submit("hello", GREEDY, lora_request="ad")
    base = producer.submit("hello", GREEDY)
    run_pool(fresh_engine(model), conn, keys, model, audit_target)

    failed = edited.result(timeout=10)
    assert failed.outputs[0].finish_reason == "error"
    assert "'ad'" in failed.error and "adapter_config.json changed since registration" in (
        failed.error
    )
    assert "lora_alpha 16.0 -> 1600.0" in failed.error, failed.error
    assert base.result(timeout=10).outputs[0].finish_reason == "length"  # others go on
    [(_, fields)] = pool_layout.entries(conn, keys, "dead")
    letter = decode_dead_letter(fields)
    assert "lora_alpha 16.0 -> 1600.0" in letter.reason
    assert letter.source == "worker" and "adapter 'ad' (id 11" in letter.reason
    (row,) = get_request(audit_target.engine, edited.request_id, pool=keys.prefix)
    assert row["finish_reason"] == "error" and "lora_alpha 16.0 -> 1600.0" in row["error"]
    # the row names the adapter version asked for (the registered one), not the edit
    assert (row["adapter_alpha"], row["adapter_digest"]) == (16.0, registered.digest)
    assert pool_layout.pending(conn, keys, "requests", "workers") == 0
    assert verify_chain(audit_target.engine, key=KEY).ok


def test_the_audit_row_names_the_files_the_worker_loaded(
    audit_target, model, conn, keys, producer, tmp_path
):
    """A record registered before config hashes (written as the old code did: no
    ``config_sha256``, no ``digest``) still serves, and its rows carry the hashes of
    what was loaded; with its alpha edited, the fields it has still refuse it."""
    adapter = build_adapter(model, tmp_path / "old", rank=4, alpha=32, seed=6)
    record = producer.registry.add("old", adapter, adapter_id=12)
    old = {k: v for k, v in record.to_dict().items() if k not in ("config_sha256", "digest")}
    conn.hset(keys.adapters, "old", orjson.dumps(old))  # as main's registry wrote it
    engine = fresh_engine(model)
    served = producer.submit("hello", GREEDY, lora_request="old")
    run_pool(engine, conn, keys, model, audit_target)
    assert served.result(timeout=10).outputs[0].finish_reason == "length"

    (row,) = get_request(audit_target.engine, served.request_id, pool=keys.prefix)
    peft = peft_config(adapter)  # the oracle: PEFT reading the same folder
    assert (row["adapter_rank"], row["adapter_alpha"]) == (peft.r, float(peft.lora_alpha))
    assert row["adapter_target_modules"] == sorted(peft.target_modules)
    weights = hashlib.sha256((adapter / "adapter_model.safetensors").read_bytes()).hexdigest()
    config = json.loads((adapter / "adapter_config.json").read_text())
    files = identity_of(config, weights)
    assert (row.get("adapter_config_sha256"), row.get("adapter_digest")) == (
        files.config_sha256,
        files.digest,
    )
    assert (record.config_sha256, record.digest) == (files.config_sha256, files.digest)
    loaded = engine.lora_manager.identity(12)  # the engine's own record of its load
    assert row["adapter_sha256"] == loaded.sha256 == weights and loaded == files

    edit_config(adapter, lora_alpha=3200)
    refused = producer.submit("hello", GREEDY, lora_request="old")
    run_pool(fresh_engine(model), conn, keys, model, audit_target)
    assert "lora_alpha 32.0 -> 3200.0" in refused.result(timeout=10).error
    assert verify_chain(audit_target.engine, key=KEY).ok


def test_the_registry_pins_the_config_and_upgrades_an_old_record(
    model, conn, keys, producer, tmp_path
):
    """``adapters add`` again of the same files writes the hashes into a record the old
    registry wrote; another config under a registered name is refused, naming it."""
    from lorapool.producer.registry import NameRefused

    adapter = build_adapter(model, tmp_path / "pin", rank=4, alpha=8, seed=2)
    record = producer.registry.add("pin", adapter)
    old = {k: v for k, v in record.to_dict().items() if k not in ("config_sha256", "digest")}
    conn.hset(keys.adapters, "pin", orjson.dumps(old))
    assert producer.registry.get("pin").digest is None
    assert producer.registry.add("pin", adapter) == record  # pinned now
    assert producer.registry.get("pin") == record
    edit_config(adapter, lora_alpha=800)
    with pytest.raises(NameRefused, match="another adapter_config.json"):
        producer.registry.add("pin", adapter)
    conn.hset(keys.adapters, "pin", orjson.dumps(old))
    with pytest.raises(NameRefused, match=r"lora_alpha 8\.0 -> 800\.0"):
        producer.registry.add("pin", adapter)
    assert producer.registry.get("pin").digest is None  # nothing written
