"""The operator's surface (issue 14 point 7): adapter roots and names, worker options, TTLs."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from lorapool.cli.main import cli
from lorapool.producer import Producer
from lorapool.protocol import SamplingParams
from lorapool.worker import Worker, WorkerConfig
from lorapool.worker.serve import base_model_info

pytestmark = pytest.mark.integration
LAYOUTS = ("standalone", "cluster")


def _adapter(path):
    path.mkdir(parents=True)
    (path / "adapter_model.safetensors").write_bytes(b"weights of " + path.name.encode())
    return path


@pytest.mark.parametrize(
    "name",
    ["", "a" * 129, "a\x00b", "../up", "a/b", "x" * 100_000, "sp ace", "naïve"],
    ids=["empty", "129-chars", "nul", "dotdot", "slash", "100kb", "space", "non-ascii"],
)
def test_registry_refuses_bad_names(conn, producer, tmp_path, name):
    registry = producer.registry
    with pytest.raises(ValueError, match="is not 1 to 128 characters"):
        registry.add(name, _adapter(tmp_path / "ad"))
    assert conn.hlen(registry.keys.adapters) == 0


def test_registry_refuses_paths_outside_its_roots(conn, producer, tmp_path):
    from lorapool.producer.registry import AdapterRegistry

    root, outside = tmp_path / "root", _adapter(tmp_path / "outside")
    inside = _adapter(root / "inside")
    (root / "link").symlink_to(outside)
    registry = AdapterRegistry(conn, producer.keys, roots=[str(root)])
    assert registry.add("ok.v1_2-x", inside).path == str(inside.resolve())
    for path in (outside, root / ".." / "outside", root / "link"):
        with pytest.raises(ValueError, match="outside the adapter roots"):
            registry.add("bad", path)
    assert [r.name for r in registry.list()] == ["ok.v1_2-x"]


def test_cli_adapters_add_with_roots(pool_url, prefix, shards, tmp_path, monkeypatch):
    root, outside = tmp_path / "root", _adapter(tmp_path / "outside")
    _adapter(root / "a")
    base = ["adapters", "add", "--redis-url", pool_url, "--prefix", prefix, "--shards", str(shards)]
    runner = CliRunner()
    result = runner.invoke(cli, [*base, "--adapter-root", str(root), "a", str(root / "a")])
    assert result.exit_code == 0, result.output
    result = runner.invoke(cli, [*base, "--adapter-root", str(root), "b", str(outside)])
    assert result.exit_code == 1 and "outside the adapter roots" in result.output
    monkeypatch.setenv("LORAPOOL_ADAPTER_ROOTS", str(root))  # the default roots
    result = runner.invoke(cli, [*base, "c", str(outside)])
    assert result.exit_code == 1 and "outside the adapter roots" in result.output


def test_worker_options_reach_engine_and_worker(monkeypatch, model, pool_url, shards, tmp_path):
    """Each operator option of `lorapool worker` lands in EngineArgs or WorkerConfig."""
    import lorapool.worker.serve as serve_module

    seen = {}
    monkeypatch.setattr(
        serve_module, "serve", lambda args, config, conn: seen.update(a=args, c=config)
    )
    args = ["worker", "--model", model, "--redis-url", pool_url, "--adapter-root", str(tmp_path)]
    args += ["--shards", str(shards)]
    args += ["--kv-cache-memory", "4194304", "--max-cpu-loras", "3", "--enable-prefix-caching"]
    args += ["--max-n", "4", "--max-prompt-bytes", "1000", "--result-ttl", "60"]
    args += ["--dead-max-len", "50"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    engine_args, config = seen["a"], seen["c"]
    assert engine_args.adapter_roots == [str(tmp_path)]
    assert engine_args.kv_cache_memory == 4 << 20 and engine_args.max_cpu_loras == 3
    assert engine_args.enable_prefix_caching
    assert (config.max_n, config.max_prompt_bytes) == (4, 1000)
    assert (config.result_ttl_s, config.dead_max_len) == (60, 50)


def test_kv_cache_memory_sizes_the_engine(model):
    from lorapool.engine.config import EngineArgs
    from lorapool.engine.llm_engine import LLMEngine

    small = LLMEngine.from_engine_args(EngineArgs(model=model, kv_cache_memory=1 << 20))
    large = LLMEngine.from_engine_args(EngineArgs(model=model, kv_cache_memory=4 << 20))
    assert 4 * small.block_manager.num_blocks == large.block_manager.num_blocks


@pytest.fixture(scope="module")
def engine(model):
    from lorapool.engine.config import EngineArgs
    from lorapool.engine.llm_engine import LLMEngine

    return LLMEngine.from_engine_args(EngineArgs(model=model, max_num_seqs=4))


def test_result_ttl_of_worker_and_of_job(engine, conn, prefix, shards, producer, model):
    params = SamplingParams(temperature=0.0, max_tokens=2)
    default = producer.submit("hello", params)
    short = Producer(conn, prefix=prefix, shards=shards, result_ttl_s=5).submit("hello", params)
    config = WorkerConfig(
        prefix=prefix, shards=shards, burst=True, result_ttl_s=600, log_grace_s=30
    )
    Worker(engine, conn, config, base_model_info(model)).run()
    keys = producer.keys
    for handle, ttl in ((default, 600), (short, 5)):
        result = handle.result(timeout=5)
        assert result.finished
        # the whole output, compacted, stays for the ttl; the chunk log for the grace
        assert ttl - 2 <= conn.ttl(keys.job(handle.request_id)) <= ttl
        assert min(ttl, 30) - 2 <= conn.ttl(keys.out(handle.request_id)) <= min(ttl, 30)
        conn.delete(keys.out(handle.request_id))  # the grace over: one record is left
        again = handle.result(timeout=5)
        assert again.outputs[0].token_ids == result.outputs[0].token_ids
        assert (again.outputs[0].text, again.prompt) == (result.outputs[0].text, result.prompt)
        assert again.metrics == result.metrics and again.worker == result.worker


def test_n_over_the_cap_is_refused_at_submit(conn, prefix, shards, keys, producer):
    with pytest.raises(ValueError, match=r"n must be at most 128 \(max_n\)"):
        producer.submit("hi", SamplingParams(n=20_000))
    with pytest.raises(ValueError, match=r"at most 4 \(max_n\)"):
        Producer(conn, prefix=prefix, shards=shards, max_n=4).submit("hi", SamplingParams(n=5))
    assert not any(conn.exists(view.requests) for view in keys.shard_views)
