"""Identity (issue 14 point 6): one base model per pool, adapter weights as registered.

The oracle for the hashes is hashlib over the files' bytes; the refusals are
checked on real Redis, with a worker process for the second base model.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import orjson
import pool_layout
import pytest

from lorapool.identity import adapter_sha256, model_identity, weights_sha256
from lorapool.lifecycle.keys import Keys
from lorapool.producer.registry import describe_adapter
from lorapool.protocol import SamplingParams
from lorapool.records.audit import record_from_dict
from lorapool.worker import ModelMismatchError, Worker, WorkerConfig

pytestmark = pytest.mark.integration
LAYOUTS = ("standalone", "cluster")
GREEDY = SamplingParams(temperature=0.0, max_tokens=4)


def _sha(*files) -> str:
    digest = hashlib.sha256()
    for file in files:
        digest.update(Path(file).read_bytes())
    return digest.hexdigest()


@pytest.fixture(scope="module")
def other_model(tiny_model_path):
    """Same shape as ``model``, other weights."""
    return str(tiny_model_path("llama", seed=7))


@pytest.fixture(scope="module")
def lora_engine(model):
    from lorapool.engine.config import EngineArgs
    from lorapool.engine.llm_engine import LLMEngine

    args = EngineArgs(model=model, max_num_seqs=8, enable_lora=True, max_loras=2, max_lora_rank=8)
    return LLMEngine.from_engine_args(args)


@pytest.fixture(scope="module")
def adapter_dir(model, tmp_path_factory):
    """One adapter for the module: ``lora_engine`` keeps the path of each adapter id it
    loaded, and both layouts' runs use it."""
    from adapters import build_adapter

    return build_adapter(model, tmp_path_factory.mktemp("adapters") / "ad", rank=4)


def test_one_identity_everywhere(
    model, tiny_model_path, adapter_dir, lora_engine, conn, keys, producer
):
    """Registry, engine, worker and audit record name the same sha256: the files' bytes."""
    from lorapool.engine.lora.adapter import load_adapter

    sharded = tiny_model_path("llama", shard=True)
    files = sorted(sharded.glob("*.safetensors"))
    assert len(files) > 1 and weights_sha256(sharded) == _sha(*files)
    assert model_identity(model).sha256 == _sha(f"{model}/model.safetensors")
    adapter = adapter_dir
    expected = _sha(adapter / "adapter_model.safetensors")
    record = producer.registry.add("ad", adapter)
    assert record.sha256 == describe_adapter(adapter)["sha256"] == expected
    assert adapter_sha256(adapter) == expected
    loaded = load_adapter(producer.registry.resolve("ad"), lora_engine.lora_manager.shapes, 8)
    assert loaded.sha256 == expected
    handle = producer.submit("hello", GREEDY, lora_request="ad")
    config = WorkerConfig(prefix=keys.prefix, shards=keys.shards, burst=True)
    Worker(lora_engine, conn, config, model_identity(model)).run()
    assert handle.result(timeout=5).outputs[0].finish_reason == "length"
    ((_, fields),) = pool_layout.entries(conn, keys, "audit")
    audit = record_from_dict(orjson.loads(fields[b"data"]))
    assert audit.adapter.sha256 == expected
    assert audit.base_model.sha256 == model_identity(model).sha256


def test_second_base_model_refuses_to_start(
    model, other_model, lora_engine, conn, keys, pool_url, tmp_path
):
    prefix = keys.prefix
    first = WorkerConfig(prefix=prefix, shards=keys.shards, burst=True)
    Worker(lora_engine, conn, first, model_identity(model)).run()  # claims the pool
    with pytest.raises(ModelMismatchError) as error:
        Worker(lora_engine, conn, first, model_identity(other_model)).run()
    message = str(error.value)
    assert model_identity(model).sha256[:12] in message
    assert model_identity(other_model).sha256[:12] in message
    cmd = [sys.executable, "-c", "from lorapool.cli.main import main; main()", "worker"]
    cmd += ["--model", other_model, "--prefix", prefix, "--redis-url", pool_url, "--burst"]
    cmd += ["--shards", str(keys.shards)]
    proc = subprocess.run(
        cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120, env=os.environ
    )
    assert proc.returncode == 1
    assert "serves base model" in proc.stderr and model_identity(other_model).name in proc.stderr
    assert conn.hlen(keys.workers) == 0


@pytest.mark.parametrize(
    "held", ["not json", '{"name": "smol"}', '{"name": 1, "sha256": []}', "hash"]
)
def test_a_pool_model_key_no_worker_wrote_refuses_start_naming_the_key(
    model, lora_engine, conn, keys, held
):
    """A ``{p}:model`` that is not a base model record (an operator's hand, another
    program, a hash): the worker refuses to start with an error naming the key, and
    leaves the key as it was, instead of a JSON or WRONGTYPE traceback."""
    if held == "hash":
        conn.hset(keys.model, "name", "smol")
    else:
        conn.set(keys.model, held)
    config = WorkerConfig(prefix=keys.prefix, shards=keys.shards, burst=True)
    with pytest.raises(ModelMismatchError, match="holds no base model record") as error:
        Worker(lora_engine, conn, config, model_identity(model)).run()
    assert keys.model in str(error.value) and "delete it" in str(error.value)
    assert conn.type(keys.model) == (b"hash" if held == "hash" else b"string")
    assert conn.hlen(keys.workers) == 0


@pytest.fixture
def two_shard_prefix(conn, prefix):
    """``prefix`` for a pool of 2 shards on a standalone Redis: ``prefix`` deletes the
    keys of the layout's own shard count (0), so those of 2 shards are deleted here."""
    yield prefix
    for key in list(conn.scan_iter(match=Keys(prefix, 2).pattern)):
        conn.delete(key)


@pytest.mark.layouts("standalone")
def test_a_sharded_pool_refuses_another_model_before_loading_it(
    model, other_model, lora_engine, conn, two_shard_prefix, pool_url, tmp_path
):
    """``lorapool worker`` claims the pool before it loads the engine, on the same key
    as the worker's loop: with ``--shards`` that is the meta shard's (``{p}:model``).
    The other model's weights here cannot load, so only that early claim refuses it
    with the mismatch."""
    prefix = two_shard_prefix
    first = WorkerConfig(prefix=prefix, shards=2, burst=True)
    Worker(lora_engine, conn, first, model_identity(model)).run()  # claims {p}:model
    broken = tmp_path / "broken"
    shutil.copytree(other_model, broken)
    for weights in broken.glob("*.safetensors"):
        weights.write_bytes(weights.read_bytes()[:100])
    cmd = [sys.executable, "-c", "from lorapool.cli.main import main; main()", "worker"]
    cmd += ["--model", str(broken), "--prefix", prefix, "--redis-url", pool_url, "--burst"]
    cmd += ["--shards", "2"]
    proc = subprocess.run(
        cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120, env=os.environ
    )
    assert proc.returncode == 1
    assert "serves base model" in proc.stderr, proc.stderr[-2000:]
    assert conn.get(f"{prefix}:model") is None  # nothing claimed under the unsharded key


def test_weights_changed_after_registration_fail_their_requests(
    model, conn, keys, producer, tmp_path
):
    from adapters import build_adapter

    from lorapool.engine.config import EngineArgs
    from lorapool.engine.llm_engine import LLMEngine

    kept = producer.registry.add("kept", build_adapter(model, tmp_path / "kept", rank=4, seed=1))
    swapped = build_adapter(model, tmp_path / "swapped", rank=4, seed=2)
    producer.registry.add("swapped", swapped)
    other = build_adapter(model, tmp_path / "other", rank=4, seed=3)
    shutil.copy(other / "adapter_model.safetensors", swapped / "adapter_model.safetensors")
    handles = {
        "swapped": producer.submit("hello", GREEDY, lora_request="swapped"),
        "kept": producer.submit("hello", GREEDY, lora_request="kept"),
        "base": producer.submit("hello", GREEDY),
    }
    args = EngineArgs(model=model, max_num_seqs=8, enable_lora=True, max_loras=2, max_lora_rank=8)
    engine = LLMEngine.from_engine_args(args)  # a fresh worker: nothing loaded yet
    config = WorkerConfig(prefix=keys.prefix, shards=keys.shards, burst=True)
    Worker(engine, conn, config, model_identity(model)).run()
    failed = handles["swapped"].result(timeout=5)
    assert failed.outputs[0].finish_reason == "error"
    assert "weights changed since registration" in failed.error and "'swapped'" in failed.error
    for name in ("kept", "base"):
        assert handles[name].result(timeout=5).outputs[0].finish_reason == "length"
    assert kept.sha256 != _sha(swapped / "adapter_model.safetensors")
    assert pool_layout.pending(conn, keys, "requests", "workers") == 0
