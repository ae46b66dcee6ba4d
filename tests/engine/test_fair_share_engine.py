"""Tenants' fair shares through the real engine (issue 51 row 4): a tiny random-weight
model, one tenant flooding with requests of n=8 samples, another sending a 1-token
completion. The light request runs at the next step (a flood sequence preempted for
it), not behind the flood; forked samples never run past max_num_seqs."""

import pytest

from lorapool.engine.config import EngineArgs
from lorapool.engine.llm_engine import LLMEngine
from lorapool.protocol import SamplingParams

MAX_NUM_SEQS, FLOOD_TOKENS = 8, 10


@pytest.fixture(scope="module")
def engine(model):
    return LLMEngine.from_engine_args(
        EngineArgs(model=model, max_num_seqs=MAX_NUM_SEQS, num_kv_blocks=512)
    )


def run(engine, light_tenant):
    """The flood (12 requests of n=8, FLOOD_TOKENS each) from tenant "flood", then,
    two steps later, one 1-token request: the steps it took, and the flood's outputs."""
    flood = SamplingParams(n=8, max_tokens=FLOOD_TOKENS, ignore_eos=True, temperature=1.0, seed=1)
    for i in range(12):
        engine.add_request(f"flood-{i}", {"prompt_token_ids": [5, 6, 7, i]}, flood, tenant="flood")
    done, steps, light_steps = {}, 0, None
    while engine.has_unfinished_requests():
        if steps == 2:
            one = SamplingParams(max_tokens=1, ignore_eos=True)
            engine.add_request("light", {"prompt_token_ids": [9, 9]}, one, tenant=light_tenant)
        outputs = engine.step()
        steps += 1
        assert len(engine.scheduler.running) <= MAX_NUM_SEQS, "forks ran past max_num_seqs"
        for output in outputs:
            if output.finished:
                done[output.request_id] = output
                if output.request_id == "light":
                    light_steps = steps - 2
    return light_steps, done


def test_a_flooding_tenant_does_not_delay_a_light_one_beyond_the_bound(engine):
    light_steps, done = run(engine, light_tenant="light")
    # the flood holds every slot: one of its sequences is preempted for the light
    # request, which runs (prefill and its one token) in the next step
    assert light_steps == 1, light_steps
    for i in range(12):  # nothing of the flood is lost: every sample has its tokens
        outputs = done[f"flood-{i}"].outputs
        assert sorted(c.index for c in outputs) == list(range(8))
        assert all(len(c.token_ids) == FLOOD_TOKENS for c in outputs)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_a_request_without_a_tenant_runs_in_the_default_tenants_share(engine):
    """The default tenant (requests without one) is a tenant of its own beside "flood":
    not starved either."""
    light_steps, _ = run(engine, light_tenant=None)
    assert light_steps == 1, light_steps


def test_a_bad_weight_fails_only_its_request(engine):
    with pytest.raises(ValueError, match="tenant_weight must be a finite number > 0"):
        engine.add_request("w", "hi", SamplingParams(max_tokens=1), tenant="a", tenant_weight=0)
    with pytest.raises(ValueError, match="priority must be an integer"):
        engine.add_request("p", "hi", SamplingParams(max_tokens=1), priority="high")
    assert not engine.has_unfinished_requests()


def test_first_come_first_served_queues_the_light_one_behind_the_flood(model):
    """The same run with the fair share off (``--no-tenant-fair-share``): what the
    bound above is measured against."""
    fcfs = LLMEngine.from_engine_args(
        EngineArgs(
            model=model, max_num_seqs=MAX_NUM_SEQS, num_kv_blocks=512, tenant_fair_share=False
        )
    )
    light_steps, _ = run(fcfs, light_tenant="light")
    assert light_steps > 3 * (FLOOD_TOKENS + 2), light_steps
