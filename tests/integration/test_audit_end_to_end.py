"""End to end: producer -> Redis -> worker -> audit stream -> writer -> SQL rows.

Every finished request has its rows, errors and aborts included, with the
adapter's full identity (checked against the adapter directory itself) and
the base model's; a base-model request has no adapter.
"""

import hashlib
from pathlib import Path

import pytest
from adapters import build_adapter

from lorapool.audit_db import AuditWriter, WriterConfig
from lorapool.audit_db.queries import get_request
from lorapool.protocol import SamplingParams
from lorapool.records.adapter import ModelIdentity
from lorapool.worker import Worker, WorkerConfig
from lorapool.worker.serve import base_model_info

pytest_plugins = ["audit_fixtures"]
pytestmark = pytest.mark.integration
LAYOUTS = ("standalone", "cluster")
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def sha256_of(*files: Path) -> str:
    digest = hashlib.sha256()
    for f in sorted(files):
        digest.update(f.read_bytes())
    return digest.hexdigest()


@pytest.fixture(scope="module")
def lora_engine(model):
    from lorapool.engine.config import EngineArgs
    from lorapool.engine.llm_engine import LLMEngine

    args = EngineArgs(model=model, enable_lora=True, max_loras=2, max_lora_rank=8, max_num_seqs=8)
    return LLMEngine.from_engine_args(args)


@pytest.fixture(scope="module")
def adapter_dir(model, tmp_path_factory):
    """One adapter version for the module: the engine is shared by both databases' runs."""
    return build_adapter(model, tmp_path_factory.mktemp("adapters") / "sql-lora", rank=8, seed=3)


def test_every_finished_request_has_its_rows(
    audit_target, lora_engine, adapter_dir, conn, keys, producer, model
):
    producer.registry.add("sql-lora", adapter_dir, adapter_id=7)
    jobs = {
        "adapter": producer.submit(
            "with an adapter", GREEDY, lora_request="sql-lora", metadata={"tenant": "acme"}
        ),
        "base": producer.submit("the base model", GREEDY),
        "n2": producer.submit(
            "two samples", SamplingParams(n=2, seed=1, max_tokens=4), lora_request="sql-lora"
        ),
        "abort": producer.submit("abort me", SamplingParams(max_tokens=300, ignore_eos=True)),
        "too-long": producer.submit({"prompt_token_ids": [5] * 600}, GREEDY),
    }
    worker = Worker(
        lora_engine,
        conn,
        WorkerConfig(prefix=keys.prefix, shards=keys.shards, lease_s=2, burst=True),
        base_model_info(model),
    )
    worker.ensure_group()
    for _ in range(3):
        worker.run_once()
    jobs["abort"].abort()
    worker.run()
    results = {name: h.result(timeout=10) for name, h in jobs.items()}
    writer = WriterConfig(prefix=keys.prefix, shards=keys.shards)
    AuditWriter(conn, audit_target.engine, writer).run(burst=True)

    rows = {name: get_request(audit_target.engine, h.request_id) for name, h in jobs.items()}
    assert {name: len(r) for name, r in rows.items()} == {
        "adapter": 1,
        "base": 1,
        "n2": 2,
        "abort": 1,
        "too-long": 1,
    }
    weights = sha256_of(*Path(model).glob("*.safetensors"))
    adapter_sha = sha256_of(adapter_dir / "adapter_model.safetensors")
    for name, job_rows in rows.items():
        for row in job_rows:
            assert row["base_model_sha256"] == weights
            assert row["arrival_time"] is not None and row["finished_time"] is not None
            assert row["finished_time"] >= row["arrival_time"]
            adapter = (
                row["adapter_name"],
                row["adapter_id"],
                row["adapter_path"],
                row["adapter_sha256"],
            )
            if name in ("adapter", "n2"):
                assert adapter == ("sql-lora", 7, str(adapter_dir), adapter_sha)
            else:
                assert adapter == (None, None, None, None)
    done = rows["adapter"][0]
    assert done["text"] == results["adapter"].outputs[0].text
    assert done["token_ids"] == results["adapter"].outputs[0].token_ids
    assert done["first_token_time"] is not None and done["tenant"] == "acme"
    assert sorted(r["completion_index"] for r in rows["n2"]) == [0, 1]
    assert rows["abort"][0]["finish_reason"] == "abort"
    assert rows["too-long"][0]["finish_reason"] == "error"
    assert "600 tokens" in rows["too-long"][0]["error"]


def test_a_worker_without_an_audit_key_refuses_to_start(lora_engine, conn, keys, monkeypatch):
    from lorapool import signing

    monkeypatch.delenv(signing.KEY_ENV)
    config = WorkerConfig(prefix=keys.prefix, shards=keys.shards)
    with pytest.raises(signing.AuditKeyError, match="no audit key"):
        Worker(lora_engine, conn, config, ModelIdentity("m", "0"))
    assert not list(conn.scan_iter(match=keys.pattern))  # refused before touching Redis


def test_nul_bytes_through_a_real_worker_are_audited_exactly(
    audit_target, lora_engine, conn, keys, producer, model
):
    handle = producer.submit("hello\x00world", GREEDY, metadata={"tenant": "t\x00"})
    config = WorkerConfig(prefix=keys.prefix, shards=keys.shards, burst=True)
    Worker(lora_engine, conn, config, base_model_info(model)).run()
    result = handle.result(timeout=10)
    writer = WriterConfig(prefix=keys.prefix, shards=keys.shards)
    stats = AuditWriter(conn, audit_target.engine, writer).run(burst=True)
    assert (stats.rows_written, stats.dead_lettered) == (1, 0)
    (row,) = get_request(audit_target.engine, handle.request_id, pool=keys.prefix)
    assert row["prompt"] == "hello\x00world" and row["tenant"] == "t\x00"
    assert row["text"] == result.outputs[0].text
    assert row["token_ids"] == result.outputs[0].token_ids
