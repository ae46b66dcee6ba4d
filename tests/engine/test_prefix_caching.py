"""Prefix caching: the block manager's hashing and eviction, and the engine end to end.

Cached KV is named by (previous block, tokens, adapter id): it never serves
another adapter or the base model, and outputs are the same with it on or off.
"""

import itertools
import random

import pytest
from adapters import ALL_TARGETS, build_adapter, peft_greedy
from engine_runs import run_jobs

from lorapool import EngineArgs, LLMEngine, LoRARequest, SamplingParams
from lorapool.engine.block_manager import BlockManager, hash_block
from lorapool.engine.scheduler import Scheduler, SchedulerConfig
from lorapool.engine.sequence import Request, Sequence

_ids = itertools.count()


def make_seq(tokens, lora_id=0, max_tokens=4):
    lora = LoRARequest(f"a{lora_id}", lora_id, "/x") if lora_id else None
    request = Request(
        f"r{next(_ids)}",
        None,
        list(tokens),
        SamplingParams(max_tokens=max_tokens),
        lora_request=lora,
        arrival_time=next(_ids),
        max_tokens=max_tokens,
    )
    seq = Sequence(next(_ids), request, 0, request.prompt_token_ids)
    request.seqs.append(seq)
    return seq


def compute(manager, seq):
    """Allocate and 'run' all of ``seq``'s uncomputed tokens, naming the full blocks."""
    start = manager.acquire_prefix(seq)
    manager.allocate(seq, seq.num_tokens - start)
    manager.cache_blocks(seq, start, seq.num_tokens)
    seq.num_computed_tokens = seq.num_tokens
    return start


# --- block manager --------------------------------------------------------
def test_block_hash_chains_and_separates_adapters():
    first = hash_block(None, [1, 2, 3, 4], 0)
    assert first == hash_block(None, [1, 2, 3, 4], 0)
    assert first != hash_block(None, [1, 2, 3, 4], 1)
    assert hash_block(first, [5, 6, 7, 8], 0) != hash_block(None, [5, 6, 7, 8], 0)
    assert hash_block(None, [1, 2], 0) != hash_block(None, [1, 2, 0], 0)


def test_freed_blocks_serve_the_same_prefix_and_adapter_only():
    manager = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    tokens = list(range(10, 20))  # 2 full blocks + 2 tokens
    a = make_seq(tokens, lora_id=1)
    assert compute(manager, a) == 0
    full = a.block_table[:2]
    manager.free(a)
    assert manager.num_free_blocks == 16 and len(manager.evictable) == 2
    again = make_seq(tokens + [7], lora_id=1)
    assert compute(manager, again) == 8 and again.block_table[:2] == full
    assert manager.ref_counts[full[0]] == 1 and full[0] not in manager.evictable
    assert compute(manager, make_seq(tokens, lora_id=2)) == 0
    assert compute(manager, make_seq(tokens)) == 0
    assert compute(manager, make_seq(tokens[:4] + [99] * 6, lora_id=1)) == 4  # diverges in block 2


def test_the_last_token_is_always_computed():
    manager = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    compute(manager, make_seq(range(8)))
    exact = make_seq(range(8))  # block-aligned and fully cached: the last block is recomputed
    assert manager.acquire_prefix(exact) == 4
    assert manager.acquire_prefix(make_seq(range(9))) == 8


def test_shared_cached_blocks_are_ref_counted():
    manager = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    a, b = make_seq(range(9)), make_seq(range(9))
    compute(manager, a)
    assert compute(manager, b) == 8
    shared = a.block_table[:2]
    assert b.block_table[:2] == shared and manager.ref_counts[shared[0]] == 2
    manager.free(a)
    assert manager.ref_counts[shared[0]] == 1 and not manager.evictable
    manager.free(b)
    assert manager.num_free_blocks == 8 and set(manager.evictable) == set(shared)


def test_eviction_takes_never_used_blocks_first_then_least_recently_freed():
    manager = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=True)
    old, new = make_seq(range(0, 4)), make_seq(range(100, 104))
    compute(manager, old)
    compute(manager, new)
    cached = old.block_table + new.block_table
    manager.free(old)
    manager.free(new)
    assert list(manager.evictable) == cached
    filler = make_seq(range(200, 210))  # 3 blocks: the 2 never used, then the oldest cached
    compute(manager, filler)
    assert filler.block_table[2] == cached[0]
    assert manager.acquire_prefix(make_seq(range(0, 5))) == 0  # evicted
    assert manager.acquire_prefix(make_seq(range(100, 105))) == 4  # still cached


def test_same_block_computed_twice_at_once_is_cached_once():
    manager = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    a, b = make_seq(range(6)), make_seq(range(6))
    for seq in (a, b):  # both admitted before either ran
        manager.allocate(seq, 6)
    for seq in (a, b):
        manager.cache_blocks(seq, 0, 6)
    first = a.block_table[0]
    manager.free(a)
    manager.free(b)
    assert manager.num_free_blocks == 8 and list(manager.evictable) == [first]
    c = make_seq(range(7))
    assert manager.acquire_prefix(c) == 4 and c.block_table == [first]


def test_fork_and_copy_on_write_with_caching():
    manager = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    parent = make_seq(range(6))
    compute(manager, parent)
    child = Sequence(999, parent.request, 1, parent.prompt_token_ids)
    manager.fork(parent, child)
    child.num_computed_tokens = 6
    copies = manager.allocate(child, 1)
    assert copies == [(parent.block_table[1], child.block_table[1])]
    assert child.block_table[0] == parent.block_table[0]
    manager.free(parent)
    manager.free(child)
    assert manager.num_free_blocks == 8 and len(manager.evictable) == 1


def test_forget_adapter_drops_its_cached_blocks():
    manager = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    a, base = make_seq(range(9), lora_id=3), make_seq(range(9))
    compute(manager, a)
    compute(manager, base)
    manager.free(a)
    manager.forget_adapter(3)
    assert manager.acquire_prefix(make_seq(range(9), lora_id=3)) == 0
    assert manager.acquire_prefix(make_seq(range(9))) == 8
    assert len(manager.hash_to_block) == 2


def test_scheduler_with_caching_under_pressure_frees_everything():
    rng = random.Random(0)
    manager = BlockManager(num_blocks=14, block_size=4, enable_prefix_caching=True)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=16, max_loras=2), manager)
    prefix = list(range(50, 62))
    seqs = [
        make_seq(
            prefix + [rng.randrange(3, 40) for _ in range(rng.randint(1, 6))],
            lora_id=rng.choice([0, 1, 2]),
            max_tokens=rng.randint(1, 8),
        )
        for _ in range(24)
    ]
    for seq in seqs:
        sched.add(seq)
    preempted = 0
    while sched.has_unfinished():
        out = sched.schedule()
        preempted += len(out.preempted)
        held = [b for s in sched.running for b in s.block_table]
        assert all(manager.ref_counts[b] == held.count(b) for b in set(held))
        sched.postprocess(out)
        for item in out.scheduled:
            if item.samples:
                item.seq.append_token(7)
                if item.seq.num_output_tokens >= item.seq.request.max_tokens:
                    sched.finish(item.seq)
    assert all(s.num_output_tokens == s.request.max_tokens for s in seqs)
    assert preempted > 0 and manager.num_hit_tokens > 0
    assert manager.num_free_blocks == 14 and not any(manager.ref_counts)


# --- engine ----------------------------------------------------------------
@pytest.fixture(scope="module")
def loras(base, tmp_path_factory):
    root = tmp_path_factory.mktemp("prefix-loras")
    specs = [(8, ["q_proj", "v_proj"]), (16, ALL_TARGETS), (8, ["k_proj", "o_proj", "up_proj"])]
    return [
        LoRARequest(
            f"p{i}", i + 1, str(build_adapter(base, root / f"p{i}", rank=r, targets=t, seed=10 + i))
        )
        for i, (r, t) in enumerate(specs)
    ]


def engine_for(base, caching=True, **kw):
    args = dict(
        model=str(base),
        enable_lora=True,
        max_loras=2,
        max_lora_rank=16,
        block_size=8,
        enable_prefix_caching=caching,
    )
    return LLMEngine.from_engine_args(EngineArgs(**{**args, **kw}))


def run(engine, jobs, every=1):
    """Add job i at step i // every; returns the final outputs in job order."""
    finals = run_jobs(engine, jobs, every)
    return [finals[f"req-{i}"] for i in range(len(jobs))]


def test_outputs_identical_with_caching_on_and_off(base, loras):
    rng = random.Random(3)
    prefixes = [[rng.randrange(3, 512) for _ in range(n)] for n in (40, 27)]
    jobs = [
        (
            rng.choice(prefixes) + [rng.randrange(3, 512) for _ in range(rng.randint(1, 9))],
            rng.randint(2, 10),
            rng.choice([None, *loras]),
        )
        for _ in range(18)
    ]
    # 16 blocks of 8 tokens: about two requests at once, so sequences get preempted.
    kw = dict(num_kv_blocks=16, max_num_batched_tokens=64, max_num_seqs=8)
    cached_engine = engine_for(base, **kw)
    on = run(cached_engine, jobs, every=2)
    off = run(engine_for(base, caching=False, **kw), jobs, every=2)
    assert [o.outputs[0].token_ids for o in on] == [o.outputs[0].token_ids for o in off]
    assert cached_engine.scheduler.num_preemptions > 0
    assert cached_engine.block_manager.num_hit_tokens > 0
    assert sum(o.num_cached_tokens > 0 for o in on) >= 3
    assert all(o.num_cached_tokens == 0 for o in off)
    for out, (prompt, max_tokens, lora) in zip(on, jobs):
        assert out.outputs[0].token_ids == peft_greedy(
            base, lora and lora.lora_path, prompt, max_tokens
        )


def test_prompt_cached_under_one_adapter_is_recomputed_for_another(base, loras):
    engine = engine_for(base)
    prompt = list(range(100, 141))  # 41 tokens: 5 full blocks of 8 before the last token
    a, b = loras[0], loras[1]
    order = [a, b, None, a, b, None]
    outs = [run(engine, [(prompt, 6, lora)])[0] for lora in order]
    assert [o.num_cached_tokens for o in outs] == [0, 0, 0, 40, 40, 40]
    assert all(o.metrics.num_cached_tokens == o.num_cached_tokens for o in outs)
    for out, lora in zip(outs, order):
        assert out.outputs[0].token_ids == peft_greedy(base, lora and lora.lora_path, prompt, 6)


def test_mixed_batch_sharing_a_prompt_across_adapters(base, loras):
    engine = engine_for(base, max_loras=3)
    prompt = list(range(200, 233))
    jobs = [(prompt, 5, lora) for lora in (None, *loras, loras[0], None)]
    outs = run(engine, jobs, every=100)  # all in one step: nothing cached yet
    assert all(o.num_cached_tokens == 0 for o in outs)
    again = run(engine, jobs, every=100)
    assert all(o.num_cached_tokens == 32 for o in again)
    for out, (p, m, lora) in zip(outs + again, jobs + jobs):
        assert out.outputs[0].token_ids == peft_greedy(base, lora and lora.lora_path, p, m)


def test_prompt_logprobs_and_n_samples_with_caching(base, loras):
    engine = engine_for(base)
    prompt = list(range(300, 330))
    run(engine, [(prompt, 4, loras[1])])
    engine.add_request(
        "lp",
        {"prompt_token_ids": prompt},
        SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=1),
        lora_request=loras[1],
    )
    engine.add_request(
        "n",
        {"prompt_token_ids": prompt},
        SamplingParams(temperature=0.0, max_tokens=4, n=3),
        lora_request=loras[1],
    )
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    expected = peft_greedy(base, loras[1].lora_path, prompt, 4)
    assert finals["lp"].num_cached_tokens == 0 and len(finals["lp"].prompt_logprobs) == 30
    assert finals["n"].num_cached_tokens == 24
    assert [c.token_ids for c in finals["n"].outputs] == [expected] * 3
    assert finals["lp"].outputs[0].token_ids == expected


def test_removed_adapter_id_reused_with_other_weights_is_not_served_stale_kv(base, loras):
    engine = engine_for(base)
    prompt = list(range(400, 425))
    run(engine, [(prompt, 4, loras[0])])
    engine.remove_lora(loras[0].lora_int_id)
    reused = LoRARequest("reused", loras[0].lora_int_id, loras[2].lora_path)
    out = run(engine, [(prompt, 4, reused)])[0]
    assert out.num_cached_tokens == 0
    assert out.outputs[0].token_ids == peft_greedy(base, loras[2].lora_path, prompt, 4)
