"""Tenants' fair shares in the scheduler (issue 51 row 4): plain Python, a simulated
model that forks ``n`` samples as the engine does. The bound checked is the one the
scheduler's docstring states, computed here from what each step scheduled."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sched_sim import INPUT_COST, OUTPUT_COST, make_request, make_scheduler, simulate, step


def request_cost_bound(request):
    """The most one request can cost (weighted): its prompt, n samples' tokens, and
    the prompt and first token again for each sample forked while no slot was free."""
    prompt, n, max_tokens = request.num_prompt_tokens, request.params.n, request.max_tokens
    total = prompt * INPUT_COST + n * max_tokens * OUTPUT_COST
    total += (n - 1) * (prompt * INPUT_COST + OUTPUT_COST)
    return total / request.weight


def check_bound(trace, added, max_num_seqs):
    """For tenants f, g: from a step s at which g gets work while f has some, through
    each step t while g still has a sequence waiting, f's weighted service exceeds
    g's by at most (max_num_seqs + 1) x L_f (the scheduler's docstring). Not for a g
    with a request of n > 1: the docstring's bound excludes a g whose request waits for
    its samples' slots (hypothesis found t0's n=2 request, with max_num_seqs=2, waiting
    10 steps while t2's requests took the slot t2 kept: 34 > 33; the starvation limit
    bounds that case instead)."""
    bound = {
        t: (max_num_seqs + 1) * max(request_cost_bound(r) for r in rs) for t, rs in added.items()
    }
    samples = {t for t, rs in added.items() if any(r.params.n > 1 for r in rs)}
    worst = 0.0
    for s, (active, *_) in enumerate(trace):
        before = trace[s - 1][0] if s else set()
        for g in active - before - samples:
            for f in active - {g}:
                excess = 0.0
                for later in trace[s:]:
                    if g not in later.waiting:
                        break
                    excess += later.service.get(f, 0.0) - later.service.get(g, 0.0)
                    worst = max(worst, excess / bound[f])
                    assert excess <= bound[f], (f, g, s, excess, bound[f])
    return worst


requests_st = st.lists(
    st.tuples(
        st.integers(0, 2),  # tenant
        st.integers(0, 12),  # arrival step
        st.integers(1, 12),  # prompt length
        st.integers(1, 8),  # max_tokens
        st.integers(1, 4),  # n
    ),
    min_size=1,
    max_size=60,
)


def check_prefill_cap(trace, cap):
    """At each step that starts with two or more tenants having work, no tenant's chunks
    hold more than ``cap`` prefill positions but one with the least counter (ties: the
    fewest running sequences), which the cap spares (the scheduler's docstring)."""
    for entry in trace:
        if len(entry.active) > 1 and cap is not None:
            over = {t for t, positions in entry.prefill.items() if positions > cap}
            assert len(over) <= 1 and over <= entry.least, (entry, cap)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    requests_st,
    st.lists(st.sampled_from([1.0, 2.0, 3.0]), min_size=3, max_size=3),
    st.integers(1, 6),
    st.integers(0, 40),
    st.none() | st.integers(1, 16),
    st.integers(1, 8),
)
def test_each_backlogged_tenants_service_is_within_the_bound_of_anothers(
    specs, weights, max_num_seqs, extra_budget, cap, window
):
    sched = make_scheduler(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_seqs + extra_budget,
        contended_prefill_tokens=cap,
        contended_window_steps=window,
    )
    arrivals = {}
    for tenant, at, prompt, max_tokens, n in specs:
        name = f"t{tenant}"
        request = make_request(name, prompt, max_tokens, n, weights[tenant], arrival=at)
        arrivals.setdefault(at, []).append(request)
    trace, added = simulate(sched, arrivals)
    check_bound(trace, added, max_num_seqs)
    check_prefill_cap(trace, cap)
    assert not sched.ledger.active and not sched.ledger.counters  # forgotten when done


def flood_and_light(fair_share):
    """Tenant "flood" queues 30 requests of n=4 at step 0; "light" sends one request
    at step 5. Returns (steps the light request waited, the trace)."""
    sched = make_scheduler(max_num_seqs=8, max_num_batched_tokens=64, fair_share=fair_share)
    flood = [make_request("flood", 6, 8, n=4, arrival=i) for i in range(30)]
    light = make_request("light", 6, 1, arrival=100)
    trace, added = simulate(sched, {0: flood, 5: [light]})
    first = next(i for i, entry in enumerate(trace) if "light" in entry.service)
    return first - 5, trace, added


def test_a_flooding_tenant_does_not_starve_a_light_one():
    waited, trace, added = flood_and_light(fair_share=True)
    # every slot is the flood's: its newest sequence is preempted for the light one,
    # admitted in the step it arrived for (_make_room)
    assert waited == 0, waited
    check_bound(trace, added, 8)
    fcfs_waited, fcfs_trace, fcfs_added = flood_and_light(fair_share=False)
    assert fcfs_waited > 50  # first come first served: behind the whole flood
    with pytest.raises(AssertionError):
        check_bound(fcfs_trace, fcfs_added, 8)


def test_forked_samples_never_run_past_max_num_seqs():
    sched = make_scheduler(max_num_seqs=4, max_num_batched_tokens=32)
    request = make_request("", 5, 6, n=10)
    other = make_request("", 3, 6, n=1)
    trace, _ = simulate(sched, {0: [request], 1: [other]})  # step() asserts the bound
    assert all(len(s.output_token_ids) == 6 for s in request.seqs) and len(request.seqs) == 10
    assert other.seqs[0].is_finished
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


def test_weights_share_the_engine_in_their_ratio():
    sched = make_scheduler(max_num_seqs=4, max_num_batched_tokens=16)
    heavy = [make_request("a", 4, 4, weight=3.0, arrival=i) for i in range(60)]
    light = [make_request("b", 4, 4, weight=1.0, arrival=i) for i in range(60)]
    served = {"a": 0, "b": 0}
    sched_steps = 0
    for r in heavy + light:
        sched.add(r.seqs[0])
    while sched_steps < 60:  # both stay backlogged: compare raw tokens served
        out = step(sched)
        for item in out.scheduled:
            served[item.seq.request.tenant] += item.num_new_tokens
        sched_steps += 1
    assert 2.0 < served["a"] / served["b"] < 4.5, served


def test_priority_orders_a_tenants_own_requests_only():
    sched = make_scheduler(max_num_seqs=1, max_num_batched_tokens=16)
    a_low = make_request("a", 2, 1, arrival=0, priority=5)
    a_high = make_request("a", 2, 1, arrival=1, priority=-5)
    b = make_request("b", 2, 1, arrival=2, priority=10)
    for r in (a_low, a_high, b):
        sched.add(r.seqs[0])
    order = []
    while sched.has_unfinished():
        out = step(sched)
        order += [i.seq.request for i in out.scheduled]
    # a's -5 goes before a's 5; b (priority 10) is not behind all of a's: its share
    assert order == [a_high, b, a_low]


def test_a_chunks_charge_is_refunded():
    sched = make_scheduler(max_num_seqs=2, max_num_batched_tokens=16)
    request = make_request("a", 3, 4)
    sched.add(request.seqs[0])
    out = sched.schedule()
    [item] = out.scheduled
    assert sched.ledger.counters["a"] == item.charge == 3 * INPUT_COST
    sched.refund(item)
    assert sched.ledger.counters["a"] == 0.0 and item.charge == 0.0


def test_a_newcomer_starts_at_the_least_active_counter():
    sched = make_scheduler(max_num_seqs=4, max_num_batched_tokens=16)
    first = make_request("a", 4, 8)
    sched.add(first.seqs[0])
    for _ in range(3):
        step(sched)
    late = make_request("b", 2, 2)
    sched.add(late.seqs[0])
    assert sched.ledger.counters["b"] == sched.ledger.counters["a"] > 0


def light_prefill_steps(window):
    """Tenant "flood" keeps long prompts coming; "light" runs one 1-token request at
    step 2. Per step from then: the flood's prefill positions."""
    sched = make_scheduler(
        max_num_seqs=8,
        max_num_batched_tokens=256,
        contended_prefill_tokens=16,
        contended_window_steps=window,
    )
    flood = [make_request("flood", 200, 1, arrival=i) for i in range(12)]
    trace, _ = simulate(sched, {0: flood, 2: [make_request("light", 4, 1, arrival=100)]})
    return [entry.prefill.get("flood", 0) for entry in trace[2:12]]


def test_the_cap_holds_for_the_window_after_another_tenant_had_work():
    # W = 1: capped while "light" has work (its one step), the whole budget after it
    assert light_prefill_steps(1)[:2] == [16, 256]
    # W = 4: capped for the 4 steps from the light tenant's last one, then not
    assert light_prefill_steps(4)[:5] == [16, 16, 16, 16, 256]
