"""What the CPU can test of the engine's CUDA path: dtype choice, option checks, KV sizing,
CUDA-graph buckets, eligibility and padding, and the fall back to eager off CUDA.

The graphs themselves (capture, replay) and pinned copies run only on a GPU: the GPU
kit (``lorapool bench gpu``, section 4) checks there that greedy tokens are the same
with and without graphs. The padded graph batch's forward is checked against the
unpadded one under the Triton interpreter in tests/kernels/test_graph_padding.py.
"""

import logging
import math

import pytest
import torch

from lorapool.engine.batch import BatchMetadata
from lorapool.engine.config import EngineArgs
from lorapool.engine.cuda_graphs import StaticBatch, bucket, capture_sizes, default_sizes, graphable
from lorapool.engine.kv_budget import activation_reserve, kv_cache_budget
from lorapool.engine.models.args import ModelArgs

CUDA, CPU = torch.device("cuda"), torch.device("cpu")
GIB = 2**30


@pytest.mark.parametrize(
    "checkpoint, want",
    [
        (torch.float32, torch.bfloat16),  # vLLM's rule: an fp32 checkpoint runs in bf16
        (torch.float16, torch.float16),
        (torch.bfloat16, torch.bfloat16),
        ("float16", torch.float16),  # configs that keep the dtype's name
        ("torch.bfloat16", torch.bfloat16),
        ("float32", torch.bfloat16),
        (None, torch.bfloat16),
    ],
)
def test_auto_dtype_on_cuda_is_half_precision(checkpoint, want):
    assert EngineArgs(model="m").resolve_dtype(CUDA, checkpoint) == want


def test_auto_dtype_on_cpu_and_explicit_dtypes():
    assert EngineArgs(model="m").resolve_dtype(CPU, torch.bfloat16) == torch.float32
    assert EngineArgs(model="m", dtype="float32").resolve_dtype(CUDA, None) == torch.float32
    assert EngineArgs(model="m", dtype="float16").resolve_dtype(CUDA, None) == torch.float16


@pytest.mark.parametrize("bad", [0, 0.0, -0.1, 1.01, math.nan, math.inf, "0.9", None])
def test_gpu_memory_utilization_is_a_share(bad):
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineArgs(model="m", gpu_memory_utilization=bad)


def test_gpu_memory_utilization_bounds_are_open_at_zero_closed_at_one():
    assert EngineArgs(model="m", gpu_memory_utilization=1).gpu_memory_utilization == 1
    assert EngineArgs(model="m", gpu_memory_utilization=0.05).gpu_memory_utilization == 0.05


@pytest.mark.parametrize("bad", [[], [0], [4, -1], [True], ["8"], "8", 8, [2.0]])
def test_cuda_graph_sizes_are_checked(bad):
    with pytest.raises(ValueError, match="cuda_graph_sizes"):
        EngineArgs(model="m", cuda_graph_sizes=bad)


def test_cuda_graph_sizes_are_sorted_without_duplicates_and_graphs_are_the_default():
    args = EngineArgs(model="m", cuda_graph_sizes=[8, 1, 8, 4])
    assert args.cuda_graph_sizes == [1, 4, 8]
    assert EngineArgs(model="m").enforce_eager is False  # measured by the GPU kit: vLLM's default


def test_default_buckets_follow_vllm():
    assert default_sizes(1) == [1]
    assert default_sizes(3) == [1, 2, 3]
    assert default_sizes(10) == [1, 2, 4, 8, 10]
    sizes = default_sizes(256)
    assert sizes[:4] == [1, 2, 4, 8] and sizes[-1] == 256
    assert all(b - a == 8 for a, b in zip(sizes[3:], sizes[4:]))


def test_capture_sizes_drop_what_exceeds_max_num_seqs():
    assert capture_sizes([1, 8, 64, 512], 64) == [1, 8, 64]
    assert capture_sizes([512], 64) == [1]  # always one graph to fall into
    assert capture_sizes(None, 16) == [1, 2, 4, 8, 16]


@pytest.mark.parametrize(
    "num_seqs, want", [(1, 1), (2, 2), (3, 4), (5, 8), (8, 8), (9, 16), (64, 64), (65, None)]
)
def test_bucket_is_the_smallest_that_holds_the_batch(num_seqs, want):
    assert bucket(num_seqs, [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]) == want


def _batch(query_lens, seq_lens, sampled=None, width=3):
    tokens = sum(query_lens)
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    sampled = len(query_lens) if sampled is None else sampled
    return BatchMetadata(
        input_ids=torch.arange(10, 10 + tokens),
        positions=torch.tensor(
            [s - 1 for s in seq_lens] if tokens == len(seq_lens) else [0] * tokens
        ),
        slot_mapping=torch.arange(100, 100 + tokens),
        block_tables=torch.arange(1, 1 + len(query_lens) * width, dtype=torch.int32).view(
            -1, width
        ),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        logits_indices=torch.arange(sampled),
    )


def test_only_pure_decode_steps_are_graphable():
    assert graphable(_batch([1, 1, 1], [5, 9, 30]))
    assert not graphable(_batch([4, 1], [4, 9]))  # a prefill in the step
    assert not graphable(_batch([1, 1], [5, 9], sampled=1))  # prompt logprobs rows


def test_adapter_steps_replay_only_where_adapter_graphs_were_captured():
    from lorapool.engine.cuda_graphs import DecodeGraphs
    from lorapool.engine.lora.layers import LoRAStep

    decode = _batch([1, 1, 1], [5, 9, 30])
    base_only = DecodeGraphs(None, [1, 2, 4], 8, CPU)
    assert base_only.can_run(decode, uses_lora=False)
    assert not base_only.can_run(decode, uses_lora=True)
    with_lora = DecodeGraphs(None, [1, 2, 4], 8, CPU, lora=(LoRAStep(), 4, 16))
    assert with_lora.can_run(decode, uses_lora=True)
    assert not with_lora.can_run(_batch([1] * 5, [3] * 5), uses_lora=False)  # over 4
    assert not DecodeGraphs(None, [4], 2, CPU).can_run(decode, False)  # 3 blocks wide
    with_lora.enabled = False
    assert not with_lora.can_run(decode, uses_lora=False)


def test_static_batch_pads_rows_past_the_batch():
    static = StaticBatch(4, 5, CPU)
    static.fill(_batch([1, 1, 1], [5, 9, 30]))  # leaves row 3 as padding
    b = static.batch
    assert b.input_ids.tolist() == [10, 11, 12, 0]
    assert b.slot_mapping.tolist() == [100, 101, 102, -1]  # padding writes no KV
    assert b.seq_lens.tolist() == [5, 9, 30, 1]
    assert b.block_tables[:3, :3].tolist() == [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert b.block_tables[:, 3:].eq(0).all() and b.block_tables[3].eq(0).all()
    assert b.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert b.logits_indices.tolist() == [0, 1, 2, 3]
    static.fill(_batch([1], [7], width=1))  # a smaller batch after a larger one: no leftovers
    assert b.slot_mapping.tolist() == [100, -1, -1, -1]
    assert b.block_tables.tolist() == [[1, 0, 0, 0, 0]] + [[0] * 5] * 3


def test_static_batch_refuses_what_does_not_fit():
    with pytest.raises(ValueError, match="does not fit"):
        StaticBatch(2, 5, CPU).fill(_batch([1, 1, 1], [5, 9, 30]))
    with pytest.raises(ValueError, match="does not fit"):
        StaticBatch(4, 2, CPU).fill(_batch([1, 1], [5, 9], width=3))


LLAMA_1B = ModelArgs(32000, 2048, 8192, 16, 32, 8, 64, 1e-5, 4096, 5e5, None, *[False] * 5)


def test_kv_budget_is_the_share_less_what_is_used_and_the_reserve():
    free, total = 70 * GIB, 80 * GIB  # 10 GiB in use: weights, context, other processes
    assert kv_cache_budget(free, total, 0.9, 2 * GIB) == int(72 * GIB) - 10 * GIB - 2 * GIB
    assert kv_cache_budget(free, total, 1.0, 0) == 70 * GIB


def test_kv_budget_says_what_to_change_when_nothing_is_left():
    with pytest.raises(ValueError, match="raise gpu_memory_utilization"):
        kv_cache_budget(10 * GIB, 80 * GIB, 0.5, 1 * GIB)  # 70 GiB used of the 40 allowed
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        kv_cache_budget(10 * GIB, 80 * GIB, 0.0, 0)


def test_activation_reserve_grows_with_the_step_and_fits_a_1b_model():
    small = activation_reserve(LLAMA_1B, 2048, 256, 2)
    assert activation_reserve(LLAMA_1B, 8192, 256, 2) > small
    assert activation_reserve(LLAMA_1B, 2048, 512, 2) > small
    assert activation_reserve(LLAMA_1B, 2048, 256, 4) > small
    # 2048 tokens of a 1B model in bf16: about 0.4 GiB of activations, 256 rows of
    # 32k logits, the slack; far below a GPU, far above nothing
    assert 0.3 * GIB < small < 2 * GIB


def test_graphs_fall_back_to_eager_off_cuda(tiny_model_path, caplog):
    from lorapool import EngineArgs as Args
    from lorapool import LLMEngine, SamplingParams

    caplog.set_level(logging.DEBUG, logger="lorapool.engine.model_runner")
    path = str(tiny_model_path("llama"))
    outs = []
    for eager in (True, False):
        engine = LLMEngine.from_engine_args(
            Args(model=path, enforce_eager=eager, cuda_graph_sizes=[1, 2, 4])
        )
        assert engine.runner.graphs is None
        for i, prompt in enumerate([[5, 6, 7], [9] * 20, [300, 4]]):
            params = SamplingParams(temperature=0.0, max_tokens=6)
            engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, params)
        done = {}
        while engine.has_unfinished_requests():
            done |= {o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished}
        outs.append(done)
    assert outs[0] == outs[1]
    assert "CUDA graphs need a CUDA device" in caplog.text


@pytest.mark.parametrize("value", ["0", "1.5", "-0.2", "nan", "x"])
def test_worker_refuses_a_gpu_memory_utilization_outside_its_range(value):
    from click.testing import CliRunner

    from lorapool.cli.main import cli

    args = ["worker", "--model", "m", "--gpu-memory-utilization", value, "--insecure-no-key"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2, result.output
    assert "--gpu-memory-utilization" in result.output


def test_a_worker_started_without_the_flag_captures_graphs():
    """The worker's default is the engine's: CUDA graphs on (``--enforce-eager`` to opt out)."""
    from lorapool.cli.options import config_from
    from lorapool.cli.queue import worker

    for argv, eager in (([], False), (["--enforce-eager"], True)):
        ctx = worker.make_context("worker", ["--model", "m", *argv])
        args = config_from(EngineArgs, dict(ctx.params))
        assert args.enforce_eager is eager


def test_worker_options_reach_engine_args():
    from lorapool.cli.options import config_from

    options = {"model": "m", "gpu_memory_utilization": 0.5, "enforce_eager": False}
    args = config_from(EngineArgs, options)
    assert (args.gpu_memory_utilization, args.enforce_eager) == (0.5, False)


def test_staged_slices_write_what_set_slot_writes():
    from lorapool.engine.lora.layers import LoRALayer, LoRAStep, stage

    gen = torch.Generator().manual_seed(0)
    layers = [LoRALayer(16, [8, 4, 4], 3, 6, torch.bfloat16, CPU, LoRAStep()) for _ in range(2)]
    for layer in layers:  # stale values the writes must not leave behind in their slices
        layer.lora_a.fill_(9.0)
        layer.lora_b.fill_(9.0)
    a, b = torch.randn(5, 16, generator=gen), torch.randn(4, 5, generator=gen)
    layers[0].set_slot(1, 2, a, b, scaling=0.5)
    layers[1].clear_slice(1, 2)
    layers[1].write_staged(1, 2, *stage(a, b, 0.5, torch.bfloat16))
    assert torch.equal(layers[0].lora_a, layers[1].lora_a)
    assert torch.equal(layers[0].lora_b, layers[1].lora_b)
    assert layers[1].lora_b[1, :5, 12:].float().sub((b * 0.5).T).abs().max() < 0.05
    assert layers[1].lora_b[1, 5:, 12:].eq(0).all() and layers[1].lora_b[1, :, :12].eq(9).all()


def test_staged_adapters_leave_with_the_cpu_cache(tiny_model_path, tmp_path):
    from adapters import build_adapter

    from lorapool import EngineArgs as Args
    from lorapool import LLMEngine, LoRARequest, SamplingParams

    path = str(tiny_model_path("llama"))
    engine = LLMEngine.from_engine_args(
        Args(model=path, enable_lora=True, max_loras=1, max_cpu_loras=1, max_lora_rank=8)
    )
    manager = engine.lora_manager
    assert manager.pin is False  # pinned host memory only for a CUDA device
    loras = [
        LoRARequest(f"a{i}", i + 1, str(build_adapter(path, tmp_path / f"a{i}", seed=i)))
        for i in range(2)
    ]
    for i, lora in enumerate(loras):
        params = SamplingParams(temperature=0.0, max_tokens=2)
        engine.add_request(f"r{i}", {"prompt_token_ids": [5, 6, 7]}, params, lora_request=lora)
        while engine.has_unfinished_requests():
            engine.step()
        assert manager.staged and set(manager.staged) <= set(manager.cpu)  # one each at most
    for lora in loras:
        engine.remove_lora(lora.lora_int_id)
    assert manager.staged == {}


def test_padded_plan_orders_tokens_by_slot_and_pads_tiles():
    from lorapool.engine.cuda_graphs import max_tiles, padded_plan

    order, tiles = padded_plan([2, -1, 0, 2, 0], 8, 4)
    assert order == [1, 5, 6, 7, 2, 4, 0, 3]  # no adapter first (padding too), then by slot
    assert tiles == [4, 6, 0, 0] + [6, 8, 0, 0] + [0, 2, 0, 0]  # empty tiles: start = end
    order, tiles = padded_plan([1] * 40, 40, max_tiles(40, 8))
    assert tiles[:3] == [0, 16, 32] and tiles[max_tiles(40, 8) :][:3] == [40, 40, 40]
    with pytest.raises(ValueError, match="do not fit"):
        padded_plan([0, 1, 2], 4, 2)


def test_max_tiles_holds_every_mix_of_adapters():
    import random

    from lorapool.engine.cuda_graphs import max_tiles, padded_plan

    rng = random.Random(0)
    for _ in range(300):
        size, loras = rng.choice([1, 2, 4, 8, 16, 24, 64, 256]), rng.choice([1, 2, 8, 64])
        slots = [rng.randrange(-1, loras) for _ in range(rng.randint(1, size))]
        padded_plan(slots, size, max_tiles(size, loras))  # raises if the bound is wrong
