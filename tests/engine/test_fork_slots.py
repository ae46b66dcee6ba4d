"""Requests of n samples and the slots their forks need (issue 51 row 4, throughput):
a request is admitted only with slots for all its samples, a sample preempted while its
siblings run starts again from their prompt blocks, a request starving for blocks lets
a tenant with nothing running pass, and the contended prefill cap spares the least
tenant. The scheduler with the simulated model of ``sched_sim`` (each test fails on the
scheduler before this change); then the real engine on the tiny random-weight model,
a restarted sample's tokens against the same request run with nothing preempted."""

import pytest
from sched_sim import make_request, make_scheduler, prefill_positions, simulate

from lorapool.engine.config import EngineArgs
from lorapool.engine.llm_engine import LLMEngine
from lorapool.protocol import SamplingParams


def test_forks_find_their_slots_and_no_prompt_is_computed_twice():
    """Before: a request was admitted for one slot and its n - 1 forks, finding every
    slot taken, waited and recomputed the whole prompt each."""
    sched = make_scheduler(max_num_seqs=8, max_num_batched_tokens=64)
    flood = [make_request("a", 12, 5, n=4, arrival=i) for i in range(6)]
    waited = []
    original = sched.fork

    def fork(parent, child):
        original(parent, child)
        waited.append(child in sched.waiting)

    sched.fork = fork
    trace, _ = simulate(sched, {0: flood})
    assert len(waited) == 6 * 3 and not any(waited), waited
    prefill = sum(sum(entry.prefill.values()) for entry in trace)
    assert prefill == 6 * 12, prefill  # each prompt once, every sample decoding after


def test_a_preempted_sample_starts_again_from_its_siblings_prompt():
    """A sample preempted for a newcomer (every slot taken) comes back while its
    siblings run: it takes the prompt's full blocks from one of them and computes only
    the rest. Before: the whole prompt again."""
    sched = make_scheduler(max_num_seqs=4, max_num_batched_tokens=64, block_size=4)
    flood = make_request("flood", 10, 8, n=4)  # 2 full blocks of 4, and 2 tokens
    light = make_request("light", 2, 1, arrival=100)
    restarts = []
    original = sched.schedule

    def schedule():
        out = original()
        restarts.extend(
            (item.start, item.num_new_tokens, item.seq.num_tokens)
            for item in out.scheduled
            if item.seq.request is flood and prefill_positions(item) and item.seq.index
        )
        return out

    sched.schedule = schedule
    simulate(sched, {0: [flood], 3: [light]})
    assert sched.num_preemptions == 1
    [(start, num_new, num_tokens)] = restarts
    assert start == 8 and num_new == num_tokens - 8 > 1, restarts
    assert all(count == 0 for count in sched.block_manager.ref_counts)  # all came back


def test_a_newcomer_passes_a_request_starving_for_blocks_for_s_steps():
    """A flood request that cannot get its blocks starves after S = 3 skips (nothing
    behind it goes first); for S more steps a tenant with nothing running and a counter
    no greater than the flood's still starts its request the step it comes (before:
    it waited for the starving request); after them nothing passes, so the starving
    request's bound holds."""
    sched = make_scheduler(
        num_blocks=14, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, starvation_steps=3
    )
    running = [make_request("flood", 8, 12, arrival=i) for i in range(2)]
    big = make_request("flood", 36, 1, arrival=2)  # 9 blocks: free only when those end
    light = make_request("light", 2, 1, arrival=100)
    late = make_request("late", 2, 1, arrival=101)
    trace, _ = simulate(sched, {0: running, 1: [big], 4: [light], 8: [late]})
    assert trace[4].waiting == {"flood", "light"}  # the big one starves by then
    assert "light" in trace[4].service, [entry.service for entry in trace[3:8]]
    big_ran = next(i for i, entry in enumerate(trace) if entry.prefill.get("flood", 0) == 36)
    late_ran = next(i for i, entry in enumerate(trace) if "late" in entry.service)
    assert 8 < big_ran <= late_ran, (big_ran, late_ran)


def light_and_flood_prefill(cap):
    sched = make_scheduler(max_num_seqs=8, max_num_batched_tokens=256, contended_prefill_tokens=cap)
    flood = [make_request("flood", 200, 1, arrival=i) for i in range(12)]
    light = make_request("light", 60, 1, arrival=100)
    trace, _ = simulate(sched, {0: flood, 2: [light]})
    return trace[2].prefill


def test_the_prefill_cap_spares_the_tenant_with_the_least_counter():
    """The light tenant's 60-token prompt runs whole in the step it comes, the flood's
    chunks beside it capped at 16. Before: the light prompt was cut to 16 a step too."""
    assert light_and_flood_prefill(16) == {"light": 60, "flood": 16}
    assert light_and_flood_prefill(None) == {"light": 60, "flood": 196}


@pytest.fixture(scope="module")
def engine(model):
    return LLMEngine.from_engine_args(EngineArgs(model=model, max_num_seqs=4, num_kv_blocks=256))


def flood_samples(engine, light_at=None):
    """Tenant "flood": one request of n=4 over a 52-token prompt (3 full blocks of 16),
    seeded; with ``light_at``, tenant "light" sends a 1-token request at that step, for
    which a flood sample is preempted (every slot taken). The flood's samples, and the
    prompt tokens each restart took from a sibling."""
    prompt = [(7 * i + 3) % 90 + 5 for i in range(52)]
    params = SamplingParams(n=4, max_tokens=12, temperature=1.0, seed=11, ignore_eos=True)
    engine.add_request("flood", {"prompt_token_ids": prompt}, params, tenant="flood")
    manager, shared = engine.scheduler.block_manager, []
    original = manager.share_prompt
    manager.share_prompt = lambda seq: shared.append(original(seq)) or shared[-1]
    try:
        step = 0
        while engine.has_unfinished_requests():
            if step == light_at:
                one = SamplingParams(max_tokens=1, ignore_eos=True)
                engine.add_request("light", {"prompt_token_ids": [9, 9]}, one, tenant="light")
            step += 1
            for output in engine.step():
                if output.finished and output.request_id == "flood":
                    result = {c.index: c.token_ids for c in output.outputs}
    finally:
        del manager.share_prompt
    assert all(count == 0 for count in manager.ref_counts)  # every block came back
    return result, [tokens for tokens in shared if tokens]


def test_a_sample_restarted_from_its_siblings_prompt_matches_one_never_preempted(engine):
    """The real engine: the preempted sample takes the 48 prompt tokens of its
    siblings' 3 full blocks and computes the rest; its seeded tokens match those of
    the same request run with nothing preempted."""
    alone, none_shared = flood_samples(engine)
    preempted = engine.scheduler.num_preemptions
    shared, restarts = flood_samples(engine, light_at=4)
    assert engine.scheduler.num_preemptions == preempted + 1
    assert none_shared == [] and restarts == [48], restarts
    assert shared == alone
    assert len({tuple(tokens) for tokens in alone.values()}) > 1  # the samples differ


def test_slots_held_for_forks_come_back_when_the_request_is_aborted(model):
    """A request of n=4 aborted while its prompt is still being computed (chunked: 16
    positions a step) held 3 slots for its forks: they come back, and the next request
    of 4 samples runs."""
    engine = LLMEngine.from_engine_args(
        EngineArgs(model=model, max_num_seqs=4, max_num_batched_tokens=16, num_kv_blocks=64)
    )
    params = SamplingParams(n=4, max_tokens=3, ignore_eos=True)
    engine.add_request("cut", {"prompt_token_ids": list(range(5, 45))}, params)
    engine.step()
    assert engine.scheduler.slots_held() == 4  # 1 running, 3 held for its forks
    engine.abort_request("cut")
    engine.step()
    assert engine.scheduler.slots_held() == 0
    engine.add_request("next", {"prompt_token_ids": [5, 6, 7]}, params)
    done = []
    while engine.has_unfinished_requests():
        done += [o for o in engine.step() if o.finished]
    assert [len(c.token_ids) for c in done[-1].outputs] == [3] * 4
