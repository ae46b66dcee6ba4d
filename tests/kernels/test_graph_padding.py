"""A decode batch padded to its CUDA graph's size (``engine.cuda_graphs.StaticBatch``) gives
the real rows the logits of the unpadded batch, and its padding rows write no KV: the
Triton kernels (interpreted) on the forward pass a graph captures.
"""

import pytest
import torch

from lorapool.engine.batch import BatchMetadata
from lorapool.engine.cuda_graphs import StaticBatch, StaticLoRA
from lorapool.engine.loader import load_model

BLOCK = 16
PROMPTS = [[5, 6, 7, 8, 9], list(range(20, 29)), list(range(100, 130))]  # 5, 9 and 30 tokens
TABLES = [[1], [2], [3, 4]]


def _prefill() -> BatchMetadata:
    ids, positions, slots, starts = [], [], [], [0]
    for prompt, table in zip(PROMPTS, TABLES):
        ids += prompt
        positions += range(len(prompt))
        slots += [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(len(prompt))]
        starts.append(len(ids))
    return BatchMetadata(
        input_ids=torch.tensor(ids),
        positions=torch.tensor(positions),
        slot_mapping=torch.tensor(slots),
        block_tables=torch.tensor([t + [0] * (2 - len(t)) for t in TABLES], dtype=torch.int32),
        seq_lens=torch.tensor([len(p) for p in PROMPTS], dtype=torch.int32),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        logits_indices=torch.tensor([s - 1 for s in starts[1:]]),
    )


def _decode(next_ids) -> BatchMetadata:
    positions = [len(p) for p in PROMPTS]
    return BatchMetadata(
        input_ids=torch.tensor(next_ids),
        positions=torch.tensor(positions),
        slot_mapping=torch.tensor(
            [t[p // BLOCK] * BLOCK + p % BLOCK for t, p in zip(TABLES, positions)]
        ),
        block_tables=torch.tensor([t + [0] * (2 - len(t)) for t in TABLES], dtype=torch.int32),
        seq_lens=torch.tensor([p + 1 for p in positions], dtype=torch.int32),
        query_start_loc=torch.arange(4, dtype=torch.int32),
        logits_indices=torch.arange(3),
    )


@torch.inference_mode()
def test_padded_decode_batch_equals_the_unpadded_one(tiny_model_path, triton_interpret):
    model, _ = load_model(tiny_model_path("llama"))
    shape = model.kv_cache_shape(8, BLOCK)
    caches = [(torch.full(shape, 7.0), torch.full(shape, 7.0)) for _ in range(model.num_layers)]
    hidden = model.forward(_prefill(), caches)
    next_ids = model.compute_logits(hidden[_prefill().logits_indices]).argmax(-1).tolist()
    decode = _decode(next_ids)
    want = model.compute_logits(model.forward(decode, caches)[decode.logits_indices])
    before = [(k.clone(), v.clone()) for k, v in caches]
    static = StaticBatch(8, 6, torch.device("cpu"))  # 5 padding rows, wider block tables
    static.fill(decode)
    got = model.compute_logits(model.forward(static.batch, caches))
    torch.testing.assert_close(got[:3], want, rtol=1e-5, atol=1e-5)
    assert got[:3].argmax(-1).tolist() == want.argmax(-1).tolist()
    written = torch.zeros(shape[0] * BLOCK, dtype=torch.bool)
    written[decode.slot_mapping] = True  # what the real rows write (again)
    for cache, cache0 in zip((t for kv in caches for t in kv), (t for kv in before for t in kv)):
        flat, flat0 = cache.view(written.shape[0], -1), cache0.view(written.shape[0], -1)
        assert torch.equal(flat[~written], flat0[~written])  # padding (slot -1) wrote nothing
        torch.testing.assert_close(flat[written], flat0[written], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("live_work", [False, True], ids=["launches-5", "live-work"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_over_a_graphs_static_tiles_equals_the_steps_own(triton_interpret, dtype, live_work):
    """The LoRA update of a padded decode batch over ``StaticLoRA``'s fixed tiles (empty
    ones included) at the largest rank equals the eager step's over its own tiles, on
    both kernel paths (``EngineArgs.lora_live_work``)."""
    from lorapool.engine.lora.layers import LoRALayer, LoRAStep
    from lorapool.kernels import LoRAMapping

    gen = torch.Generator().manual_seed(0)
    slots, max_loras, max_rank, size = [2, -1, 0, 2, 0, 1, 2], 4, 16, 16
    step = LoRAStep(live_work)
    layer = LoRALayer(32, [24, 8, 8], max_loras, max_rank, dtype, torch.device("cpu"), step)
    for slot, rank in enumerate([4, 8, 16, 8]):  # ranks below max_rank: zeros past them
        for index, width in enumerate([24, 8, 8]):
            a, b = torch.randn(rank, 32, generator=gen), torch.randn(width, rank, generator=gen)
            layer.set_slot(slot, index, a, b, scaling=0.5)
    x = torch.randn(size, 32, generator=gen).to(dtype)
    base = torch.randn(size, 40, generator=gen).to(dtype)
    step.set(LoRAMapping.from_slots(slots, "cpu"), 16)
    want = layer.apply(x[: len(slots)], base[: len(slots)].clone())
    static = StaticLoRA(size, max_loras, torch.device("cpu"))
    assert static.mapping.work_tiles < static.num_tiles  # split-K sized by the live tiles
    static.fill(slots)
    step.set(static.mapping, max_rank)
    got = layer.apply(x, base.clone())
    torch.testing.assert_close(got[: len(slots)], want, rtol=1e-2, atol=1e-2)
    assert torch.equal(got[len(slots) :], base[len(slots) :])  # padding rows: no adapter
