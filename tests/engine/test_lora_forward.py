"""The LoRA forward pass of a mixed-adapter batch against PEFT, per sequence."""

import pytest
import torch
from adapters import ALL_TARGETS, build_adapter
from peft import PeftModel
from transformers import AutoModelForCausalLM

from lorapool.engine.batch import BatchMetadata
from lorapool.engine.config import EngineArgs
from lorapool.engine.loader import load_model
from lorapool.engine.lora.manager import LoRAManager
from lorapool.protocol import LoRARequest

SPECS = [  # rank, targets, alpha, rslora
    (8, ["q_proj", "v_proj"], 16, False),
    (16, ALL_TARGETS, 8, False),
    (4, ["o_proj", "down_proj"], 4, True),
    (16, ["k_proj", "gate_proj", "up_proj"], 32, False),
]


@pytest.fixture(scope="module")
def setup(tiny_model_path, tmp_path_factory):
    base = tiny_model_path("llama")
    root = tmp_path_factory.mktemp("adapters")
    dirs = [
        build_adapter(base, root / f"a{i}", rank=r, targets=t, alpha=a, use_rslora=rs, seed=i)
        for i, (r, t, a, rs) in enumerate(SPECS)
    ]
    return base, dirs


def prefill_batch(prompts: list[list[int]], block_size: int = 16) -> BatchMetadata:
    ids, pos, slots, tables, lens, starts, block = [], [], [], [], [], [0], 0
    for p in prompts:
        nblocks = -(-len(p) // block_size)
        table = list(range(block, block + nblocks))
        block += nblocks
        ids += p
        pos += range(len(p))
        slots += [table[i // block_size] * block_size + i % block_size for i in range(len(p))]
        tables.append(table)
        lens.append(len(p))
        starts.append(len(ids))
    width = max(len(t) for t in tables)
    return BatchMetadata(
        input_ids=torch.tensor(ids),
        positions=torch.tensor(pos),
        slot_mapping=torch.tensor(slots),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        logits_indices=torch.arange(len(ids)),
    )


def run_ours(model, manager, prompts, lora_ids):
    requests = [r for r in lora_ids if r is not None]
    assert not manager.activate(requests)
    token_slots = []
    for p, r in zip(prompts, lora_ids):
        slot = -1 if r is None else manager.slots.index(r.lora_int_id)
        token_slots += [slot] * len(p)
    manager.set_step(token_slots, torch.device("cpu"))
    batch = prefill_batch(prompts)
    shape = model.kv_cache_shape(16, 16)
    caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(model.num_layers)]
    return model.compute_logits(model.forward(batch, caches)), batch


@torch.inference_mode()
def peft_logits(base, adapter_dir, prompt):
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32).eval()
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, str(adapter_dir)).eval()
    return model(torch.tensor([prompt])).logits[0]


def test_mixed_batch_logits_match_peft(setup):
    base, dirs = setup
    model, _ = load_model(base)
    args = EngineArgs(model=str(base), enable_lora=True, max_loras=4, max_lora_rank=16)
    manager = LoRAManager(model, args, torch.device("cpu"), torch.float32)
    requests = [LoRARequest(f"a{i}", i + 1, str(d)) for i, d in enumerate(dirs)]
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (5, 17, 9, 12, 7)]
    lora_of = [requests[0], None, requests[1], requests[2], requests[3]]
    logits, batch = run_ours(model, manager, prompts, lora_of)
    starts = batch.query_start_loc.tolist()
    for i, (prompt, req) in enumerate(zip(prompts, lora_of)):
        expected = peft_logits(base, None if req is None else dirs[req.lora_int_id - 1], prompt)
        torch.testing.assert_close(
            logits[starts[i] : starts[i + 1]], expected, rtol=1e-4, atol=1e-4, msg=f"sequence {i}"
        )
