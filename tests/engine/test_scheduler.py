"""The scheduler and block manager alone: plain Python, a simulated model."""

import itertools
import random

import pytest

from lorapool.engine.block_manager import BlockManager
from lorapool.engine.scheduler import Scheduler, SchedulerConfig
from lorapool.engine.sequence import Request, Sequence
from lorapool.protocol import LoRARequest, SamplingParams

_ids = itertools.count()


def make_seq(prompt_len, max_tokens, lora_id=0, arrival=None):
    lora = LoRARequest(f"a{lora_id}", lora_id, "/x") if lora_id else None
    request = Request(
        f"r{next(_ids)}",
        None,
        list(range(prompt_len)),
        SamplingParams(max_tokens=max_tokens),
        lora_request=lora,
        arrival_time=arrival if arrival is not None else next(_ids),
        max_tokens=max_tokens,
    )
    seq = Sequence(next(_ids), request, 0, request.prompt_token_ids)
    request.seqs.append(seq)
    return seq


def make_scheduler(num_blocks=64, block_size=4, **config):
    return Scheduler(SchedulerConfig(**config), BlockManager(num_blocks, block_size))


def check_invariants(sched, out):
    config = sched.config
    assert out.num_batched_tokens <= config.max_num_batched_tokens
    assert len(sched.running) <= config.max_num_seqs
    if config.max_loras is not None:
        assert len(out.lora_ids) <= config.max_loras
    held = [b for s in sched.running for b in s.block_table]
    assert len(held) == len(set(held)), "two running sequences hold the same block"
    for item in out.scheduled:
        need = -(-(item.start + item.num_new_tokens) // sched.block_manager.block_size)
        assert len(item.seq.block_table) >= need


def step(sched):
    """One engine step with a model that emits token 7 whenever a sequence samples."""
    out = sched.schedule()
    check_invariants(sched, out)
    sched.postprocess(out)
    finished = []
    for item in out.scheduled:
        if item.samples:
            item.seq.append_token(7)
            if item.seq.num_output_tokens >= item.seq.request.max_tokens:
                sched.finish(item.seq)
                finished.append(item.seq)
    return out, finished


def run_all(sched, arrivals, max_steps=10_000):
    """arrivals: {step: [seqs]}; runs until all finish; returns (steps, outputs per step)."""
    history = []
    pending = dict(arrivals)
    for n in range(max_steps):
        for seq in pending.pop(n, []):
            sched.add(seq)
        if not sched.has_unfinished() and not pending:
            return history
        history.append(step(sched))
    raise AssertionError("did not finish: deadlock or starvation")


def test_continuous_batching_joins_and_leaves_every_step():
    sched = make_scheduler()
    a, b = make_seq(3, 2), make_seq(3, 6)
    sched.add(a)
    sched.add(b)
    step(sched)  # both prefill
    c = make_seq(2, 1)
    sched.add(c)
    out, _ = step(sched)  # a and b decode, c prefills in the same step
    assert {i.seq for i in out.scheduled} == {a, b, c}
    assert [i.num_new_tokens for i in out.scheduled] == [1, 1, 2]
    assert a.is_finished and c.is_finished and not b.is_finished
    out, _ = step(sched)
    assert [i.seq for i in out.scheduled] == [b]


def test_chunked_prefill_respects_token_budget():
    sched = make_scheduler(max_num_batched_tokens=8, max_num_seqs=4)
    seq = make_seq(21, 1)
    sched.add(seq)
    chunks = []
    while not seq.is_finished:
        out, _ = step(sched)
        chunks.append(out.scheduled[0].num_new_tokens)
    assert chunks == [8, 8, 5]


def test_first_come_first_served_and_max_num_seqs():
    sched = make_scheduler(max_num_seqs=2, max_num_batched_tokens=64)
    seqs = [make_seq(2, 3) for _ in range(4)]
    for s in seqs:
        sched.add(s)
    out, _ = step(sched)
    assert [i.seq for i in out.scheduled] == seqs[:2]
    history = run_all(sched, {})
    order = [s for out, fin in history for s in fin]
    assert order == seqs


def test_preemption_by_recompute_never_deadlocks_or_drops():
    rng = random.Random(0)
    # 12 blocks of 4 tokens: far fewer than the workload wants at once.
    sched = make_scheduler(num_blocks=12, block_size=4, max_num_batched_tokens=16)
    arrivals = {}
    seqs = []
    for _n in range(20):
        seq = make_seq(rng.randint(1, 20), rng.randint(1, 20))
        seqs.append(seq)
        arrivals.setdefault(rng.randint(0, 30), []).append(seq)
    history = run_all(sched, arrivals)
    assert all(s.is_finished for s in seqs)
    assert all(s.num_output_tokens == s.request.max_tokens for s in seqs)
    assert any(out.preempted for out, _ in history), "the pool was meant to force preemption"
    assert sched.block_manager.num_free_blocks == 12


def test_preempted_sequence_is_recomputed_from_its_tokens():
    sched = make_scheduler(num_blocks=3, block_size=4, max_num_batched_tokens=16)
    old, new = make_seq(4, 8, arrival=0), make_seq(4, 8, arrival=1)
    sched.add(old)
    sched.add(new)
    preempted = None
    while preempted is None:
        out, _ = step(sched)
        preempted = out.preempted[0] if out.preempted else None
    assert preempted is new  # the newest goes first
    assert new.num_computed_tokens == 0 and new.block_table == []
    assert sched.waiting[0] is new
    out, _ = step(sched)
    run_all(sched, {})
    assert new.num_output_tokens == 8 and old.num_output_tokens == 8


def test_abort_frees_blocks_wherever_the_sequence_is():
    sched = make_scheduler(num_blocks=8, max_num_seqs=1)
    running, waiting = make_seq(5, 10), make_seq(5, 10)
    sched.add(running)
    sched.add(waiting)
    step(sched)
    sched.finish(running)
    sched.finish(waiting)
    assert not sched.has_unfinished()
    assert sched.block_manager.num_free_blocks == 8


def test_max_loras_per_step_and_starvation_bound():
    sched = make_scheduler(
        num_blocks=400, max_num_seqs=16, max_num_batched_tokens=64, max_loras=2, starvation_steps=4
    )
    rng = random.Random(1)
    arrivals, seqs = {}, []
    for n in range(60):
        seq = make_seq(rng.randint(2, 10), rng.randint(2, 12), lora_id=rng.randint(0, 6), arrival=n)
        seqs.append(seq)
        arrivals.setdefault(n // 3, []).append(seq)
    first_run = {}
    history = run_all(sched, arrivals)
    for n, (out, _) in enumerate(history):
        assert len(out.lora_ids) <= 2
        for item in out.scheduled:
            first_run.setdefault(item.seq, n)
    assert all(s.is_finished for s in seqs)
    # The stated bound: (k + 1) * (S + D), k = distinct adapters that arrived before it.
    longest = max(s.num_prompt_tokens + s.request.max_tokens for s in seqs)
    for seq in seqs:
        arrived = next(k for k, v in arrivals.items() if seq in v)
        ahead = {s.lora_int_id for s in seqs[: seqs.index(seq)]} - {0, seq.lora_int_id}
        bound = (len(ahead) + 1) * (sched.config.starvation_steps + longest)
        assert first_run[seq] - arrived <= bound


def test_skipped_adapter_does_not_block_others():
    sched = make_scheduler(max_loras=1, max_num_batched_tokens=64)
    a, b, base = make_seq(2, 5, lora_id=1), make_seq(2, 5, lora_id=2), make_seq(2, 5)
    for s in (a, b, base):
        sched.add(s)
    out, _ = step(sched)
    assert {i.seq for i in out.scheduled} == {a, base}


def test_fork_shares_blocks_and_copies_on_write():
    manager = BlockManager(num_blocks=8, block_size=4)
    parent = make_seq(6, 4)
    manager.allocate(parent, 6)
    parent.num_computed_tokens = 6
    child = Sequence(99, parent.request, 1, parent.prompt_token_ids)
    manager.fork(parent, child)
    child.num_computed_tokens = 6
    assert child.block_table == parent.block_table
    assert manager.num_free_blocks == 6
    copies = manager.allocate(child, 1)  # writes into the shared, half-full block
    assert copies == [(parent.block_table[1], child.block_table[1])]
    assert child.block_table[0] == parent.block_table[0]  # the full block stays shared
    assert manager.allocate(parent, 1) == []  # parent is now its block's only holder
    manager.free(parent)
    manager.free(child)
    assert manager.num_free_blocks == 8


def test_block_manager_refuses_what_does_not_fit():
    manager = BlockManager(num_blocks=2, block_size=4)
    seq = make_seq(9, 1)
    assert not manager.can_allocate(seq, 9)
    assert manager.can_allocate(seq, 8)
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(0, 4)


def test_waiting_for_blocks_does_not_block_later_ones_and_its_wait_is_bounded():
    # 10 blocks of 4 tokens; "long" holds 5 or 6 (20 to 24 tokens), "big" needs 6 to start
    sched = make_scheduler(
        num_blocks=10, block_size=4, max_num_batched_tokens=64, starvation_steps=3
    )
    long, big = make_seq(20, 4, arrival=0), make_seq(24, 2, arrival=1)
    sched.add(long)
    sched.add(big)
    step(sched)
    assert sched.waiting[0] is big and not sched.starving()
    small = make_seq(2, 2, arrival=2)
    sched.add(small)
    out, _ = step(sched)  # big is skipped: small (1 block) runs meanwhile
    assert small in {i.seq for i in out.scheduled} and sched.waiting[0] is big
    step(sched)  # big skipped a third time: it starves
    assert sched.starving()
    late = make_seq(2, 2, arrival=3)
    sched.add(late)
    out, _ = step(sched)  # nothing goes ahead of a starving sequence
    assert late not in {i.seq for i in out.scheduled} and list(sched.waiting) == [big, late]
    history = run_all(sched, {})
    order = [s for _, fin in history for s in fin]
    assert order.index(big) < order.index(late)  # admitted before the newcomer
    assert all(s.is_finished for s in (long, big, small, late)) and not sched.num_skipped
