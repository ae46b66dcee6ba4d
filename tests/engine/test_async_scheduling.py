"""Async scheduling (``engine.async_scheduling``): the next step queued before this
step's tokens are read back. What the flag alone does (the tests it shares with async
output processing are in test_async_steps.py): steps left in flight, greedy and drawn
on the device, against the synchronous engine; the order of forwards and read-backs; a
step that raises with one in flight; a row computed after its sequence ended.
"""

from __future__ import annotations

import itertools

import pytest
from async_runs import KINDS, STOPS, drive, make, run_ids
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lorapool import SamplingParams


@pytest.fixture(scope="module")
def path(tiny_model_path):
    return tiny_model_path("llama")


@st.composite
def device_job(draw):
    """A request whose steps async scheduling leaves in flight (all but a fork's):
    greedy, or drawn on the device (seeded; temperature, top-k, top-p, min-p; n samples,
    left in flight once forked), with logprobs, penalties (counting the token in flight),
    logit_bias, min_tokens or not; aborted at a step or not."""
    prompt = draw(st.lists(st.integers(3, 511), min_size=1, max_size=40))
    max_tokens = draw(st.integers(1, 20))
    sampled = draw(st.booleans())
    params = SamplingParams(
        temperature=draw(st.sampled_from([0.7, 1.0, 1.3])) if sampled else 0.0,
        top_k=draw(st.sampled_from([-1, 20])) if sampled else -1,
        top_p=draw(st.sampled_from([1.0, 0.9, 0.5])) if sampled else 1.0,
        min_p=draw(st.sampled_from([0.0, 0.05])) if sampled else 0.0,
        seed=draw(st.integers(0, 2**32)) if sampled else None,
        n=draw(st.sampled_from([1, 1, 3])) if sampled else 1,
        max_tokens=max_tokens,
        min_tokens=draw(st.sampled_from([0, 0, 0, min(2, max_tokens)])),
        stop=draw(st.lists(st.sampled_from(STOPS), max_size=2, unique=True)),
        stop_token_ids=draw(st.lists(st.integers(3, 511), max_size=3)),
        include_stop_str_in_output=draw(st.booleans()),
        ignore_eos=draw(st.booleans()),
        output_kind=draw(st.sampled_from(KINDS)),
        logprobs=draw(st.sampled_from([None, None, 0, 3])),
        repetition_penalty=draw(st.sampled_from([1.0, 1.0, 1.3])),
        frequency_penalty=draw(st.sampled_from([0.0, 0.0, 1.5])),
        presence_penalty=draw(st.sampled_from([0.0, 0.0, -1.0, 2.0])),
        logit_bias=draw(st.sampled_from([None, {7: 4.0, 100: -50.0}])),
    )
    return prompt, params, draw(st.integers(0, 6)), draw(st.none() | st.integers(0, 25))


def drive_aborting(engine, jobs):
    """``drive``'s, for jobs (rid, prompt, params, arrival step, abort step or None):
    each request's outputs in order (logprobs: their tokens and ranks), and apart, the
    logprob values (a batch of another size moves them by float ulps)."""
    streamed: dict[str, list] = {}
    values: dict[str, list] = {}
    pending, step = sorted(jobs, key=lambda j: j[3]), 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][3] <= step:
            rid, prompt, params, *_ = pending.pop(0)
            engine.add_request(rid, {"prompt_token_ids": prompt}, params)
        engine.abort_request([j[0] for j in jobs if j[4] == step and j[0] in engine.requests])
        for out in engine.step():
            got = []
            for c in out.outputs:
                ranks = [{t: lp.rank for t, lp in d.items()} for d in c.logprobs or []]
                got.append((c.index, c.text, list(c.token_ids), c.finish_reason, c.stop_reason))
                got.append(ranks)
                values.setdefault(out.request_id, []).extend(
                    lp.logprob for d in c.logprobs or [] for lp in d.values()
                )
            streamed.setdefault(out.request_id, []).append((out.finished, got))
        step += 1
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not engine.requests and engine._in_flight is None
    return streamed, values


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(jobs=st.lists(device_job(), min_size=1, max_size=8))
def test_steps_left_in_flight_stream_and_end_as_without_it(path, jobs):
    """Greedy and seeded sampled requests, n of them forked (most steps left in flight),
    with logprobs, penalties, logit_bias and min_tokens or not, stop strings and ids,
    arriving and aborted at different steps: each request streams and ends as in
    the synchronous engine, whose schedule this one keeps (room for every request: no
    preemption, no chunking; prefix caching names the blocks a step filled once its
    tokens are in)."""
    kw = {"max_num_seqs": 16, "max_num_batched_tokens": 512, "enable_prefix_caching": True}
    run = next(run_ids)
    named = [(f"{run}-{i}", *job) for i, job in enumerate(jobs)]
    sync, sync_values = drive_aborting(make(path, None, **kw), named)
    later, later_values = drive_aborting(make(path, "async_scheduling", **kw), named)
    assert later == sync
    for rid, got in sync_values.items():
        assert later_values[rid] == pytest.approx(got, abs=1e-4), rid


@pytest.mark.parametrize(
    ("temperature", "top_p", "logprobs", "n"),
    [(0.0, 1.0, None, 1), (1.0, 1.0, None, 1), (1.0, 0.9, None, 1), (0.0, 1.0, 2, 1),
     (0.0, 1.0, "penalties", 1), (1.0, 1.0, None, 3)],
    ids=["greedy", "sampled", "top-p", "logprobs", "penalties", "forked"],
)  # fmt: skip
def test_the_next_step_is_queued_before_this_ones_tokens_are_read(
    path, monkeypatch, temperature, top_p, logprobs, n
):
    """A step's tokens (greedy, or drawn on the device at temperature 1, with top-p,
    logprobs or penalties and min_tokens or not, n samples once forked) are read back
    only after the next step's forward was queued (on a GPU the host packs and queues it
    while the device runs); its outputs come from the step() call after. The reads and
    forwards are counted in the engine's own order: forward 0, forward 1, read 0,
    forward 2, read 1, ... The step that forks n samples (their first tokens) reads
    back at once, as it must."""
    from lorapool.engine import async_scheduling

    events, reads = [], itertools.count()

    class Recorded(async_scheduling.ReadBack):
        __slots__ = ("n",)

        def tolist(self):
            events.append(("read", self.n))
            return super().tolist()

    def read_back(tensor):
        copy = Recorded(tensor)
        copy.n = next(reads)
        return copy

    monkeypatch.setattr(async_scheduling, "read_back", read_back)
    penalties = {"frequency_penalty": 1.0, "min_tokens": 3} if logprobs == "penalties" else {}
    params = SamplingParams(
        **penalties,
        temperature=temperature,
        top_p=top_p,
        logprobs=None if penalties else logprobs,
        seed=5,
        n=n,
        max_tokens=4,
        ignore_eos=True,
    )
    arrivals = []
    for mode in (None, "async_scheduling"):
        engine = make(path, mode)
        execute, forwards = engine.runner.execute, itertools.count()

        def counted(batch, execute=execute, forwards=forwards):
            events.append(("forward", next(forwards)))
            return execute(batch)

        engine.runner.execute = counted
        events.clear()
        engine.add_request("x", {"prompt_token_ids": [5, 17, 99]}, params)
        calls = []
        while engine.has_unfinished_requests():
            calls.append([[len(c.token_ids) for c in o.outputs] for o in engine.step()])
        arrivals.append((calls, list(events)))
    (sync_calls, sync_events), (calls, events_seen) = arrivals
    assert sync_calls == [[[k] * n] for k in (1, 2, 3, 4)]
    assert sync_events == [("forward", i) for i in range(4)]  # no step left in flight
    forwards = [("forward", i) for i in range(5)]
    reads_seen = [("read", i) for i in range(4)]
    # the last token (max_tokens) is known to be the last before it lands: no step after
    if n == 1:
        assert calls == [[], [[1]], [[2]], [[3]], [[4]]]
        assert events_seen == [forwards[0]] + [
            e for i in range(3) for e in (forwards[i + 1], reads_seen[i])
        ] + [reads_seen[3]]
    else:  # the first step forks, at once; the others as above
        assert calls == [[[1] * n], [], [[2] * n], [[3] * n], [[4] * n]]
        assert events_seen == forwards[:2] + [
            e for i in range(2) for e in (forwards[i + 2], reads_seen[i])
        ] + [reads_seen[2]]


def test_a_step_that_raises_with_a_step_in_flight_leaves_the_engine_whole(path):
    """A forward that raises after the placeholders were taken (a device error): the
    worker aborts the step's requests (``Worker._fail_step``); each ends with the tokens
    the synchronous engine has after as many steps (no placeholder among them), its
    blocks free, and the next requests run as in the synchronous engine."""
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    ended = []
    for mode in (None, "async_scheduling"):
        engine = make(path, mode)
        for i in range(3):
            engine.add_request(f"a{i}", {"prompt_token_ids": [5 + i, 17, 99]}, params)
        for _ in range(4):
            engine.step()
        execute = engine.runner.execute

        def broken(batch):
            raise RuntimeError("device lost")

        engine.runner.execute = broken
        with pytest.raises(RuntimeError, match="device lost"):
            engine.step()
        engine.runner.execute = execute
        engine.abort_request(list(engine.requests))
        outs = engine.step()
        assert not engine.requests and engine._in_flight is None
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
        ended.append({o.request_id: list(o.outputs[0].token_ids) for o in outs})
    assert ended[1] == ended[0] and all(len(ids) == 4 for ids in ended[0].values())
    jobs = [(f"b{i}", [9, i + 3, 40], params, 0) for i in range(3)]
    assert drive(engine, jobs) == drive(make(path, None), jobs)


def test_a_row_computed_after_its_sequence_ended_names_no_block(path):
    """A request that a stop token ends at a step in flight (not known before its token
    lands, unlike max_tokens) still ran in the step queued after it: that row fills its
    block's last slot (prompts of 15 tokens whose first token stops them, blocks of 16),
    but its blocks are free by then and nothing names them; the same prompts again find
    the prompt blocks the synchronous engine names, and end as there."""
    prompts = [[3 + i] + list(range(20, 34)) + [7] * i for i in range(3)]  # 15, 16, 17
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    first_tokens = drive(make(path, None), [(f"t{i}", p, one, 0) for i, p in enumerate(prompts)])
    stops = sorted({out[-1][2][0][2][0] for out in first_tokens[0].values()})
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, stop_token_ids=stops)
    again = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    runs = []
    for mode in (None, "async_scheduling"):
        engine = make(path, mode, enable_prefix_caching=True, block_size=16)
        first, _ = drive(engine, [(f"a{i}", p, params, 0) for i, p in enumerate(prompts)])
        named = sorted(d for d in engine.block_manager.block_hashes if d is not None)
        second, _ = drive(engine, [(f"b{i}", p, again, 0) for i, p in enumerate(prompts)])
        runs.append((first, named, second))
    assert {out[-1][2][0][3] for out in runs[0][0].values()} == {"stop"}
    assert len(runs[0][1]) == 2  # the first blocks of the prompts of 16 and 17 tokens
    assert runs[1] == runs[0]


def test_penalties_count_the_token_in_flight(path):
    """Greedy requests whose penalties decide their tokens (a random model repeats
    itself): the token a step left in flight is penalized in the next step as it is in
    the synchronous engine, where it was read back before; these steps are left in
    flight all the same."""
    params = [
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, **penalty)
        for penalty in (
            {"repetition_penalty": 3.0},
            {"frequency_penalty": 2.0},
            {"presence_penalty": 2.0, "min_tokens": 20},
        )
    ]
    runs = []
    for mode in (None, "async_scheduling"):
        engine = make(path, mode)
        for i, p in enumerate(params):
            for j, prompt in enumerate(([5, 17, 99], [40, 41], [7, 7, 7, 7])):
                engine.add_request(f"{i}-{j}", {"prompt_token_ids": prompt}, p)
        done, steps = {}, 0
        while engine.has_unfinished_requests():
            done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
            steps += engine._in_flight is not None
        runs.append((done, steps))
    (sync, _), (later, in_flight) = runs
    assert later == sync
    assert in_flight >= 20
