"""Async output processing (``engine.async_output``) and async scheduling
(``engine.async_scheduling``): with either on, every request streams and ends as it does
without it. Async output makes the text and outputs of a request's tokens between its
first and its end during the next step; async scheduling queues the next step before a
step's tokens are read back, and makes that step's outputs meanwhile (what it alone
does: test_async_scheduling.py).

Oracles: transformers' greedy tokens; the synchronous engine (itself checked against
transformers, PEFT and the sampler's references in the other engine tests) for what
transformers does not say (stop strings, forks, seeded draws, logprobs, streamed text);
the tokenizer's own decode for the text of an aborted request; the fair-share ledger
of the synchronous engine at the same tokens.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
from async_runs import KINDS, STOPS, drive, make, run_ids
from engine_runs import assert_matches_transformers, workload
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lorapool import RequestOutputKind, SamplingParams
from lorapool.records.structured import StructuredOutputsParams


@pytest.fixture(scope="module")
def path(tiny_model_path):
    return tiny_model_path("llama")


ASYNC = ["async_output_proc", "async_scheduling"]  # EngineArgs' flags
MODES = pytest.mark.parametrize("mode", ASYNC, ids=["async_output", "async_sched"])


@pytest.fixture(scope="module", params=ASYNC, ids=["async_output", "async_sched"])
def pair(path, request):
    """The synchronous engine and an async one, small enough to preempt (28 blocks of 16
    tokens) and to make forks wait for slots (max_num_seqs 6)."""
    kw = {"num_kv_blocks": 28, "max_num_seqs": 6, "max_num_batched_tokens": 64}
    return make(path, None, **kw), make(path, request.param, **kw)


@MODES
def test_greedy_matches_transformers_with_preemption_and_chunked_prefill(path, mode):
    requests = workload(2, 16, 512, max_out=40)
    engine = make(path, mode, num_kv_blocks=24)
    assert_matches_transformers(path, engine, requests, every=0)
    assert engine.scheduler.num_preemptions > 0
    chunked = make(path, mode, max_num_batched_tokens=16, max_num_seqs=16)
    assert_matches_transformers(path, chunked, requests)


@st.composite
def job(draw):
    prompt = draw(st.lists(st.integers(3, 511), min_size=1, max_size=60))
    sampled = draw(st.booleans())
    max_tokens = draw(st.integers(1, 24))
    params = SamplingParams(
        temperature=draw(st.sampled_from([0.7, 1.0, 1.3])) if sampled else 0.0,
        top_p=draw(st.sampled_from([1.0, 0.9])) if sampled else 1.0,
        top_k=draw(st.sampled_from([-1, 20])) if sampled else -1,
        seed=draw(st.integers(0, 2**32)) if sampled else None,
        n=draw(st.integers(1, 3)) if sampled else 1,
        max_tokens=max_tokens,
        min_tokens=draw(st.integers(0, min(3, max_tokens))),
        stop=draw(st.lists(st.sampled_from(STOPS), max_size=2, unique=True)),
        stop_token_ids=draw(st.lists(st.integers(3, 511), max_size=3)),
        include_stop_str_in_output=draw(st.booleans()),
        logprobs=draw(st.sampled_from([None, 0, 2])),
        ignore_eos=draw(st.booleans()),
        output_kind=draw(st.sampled_from(KINDS)),
    )
    return prompt, params, draw(st.integers(0, 6))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(jobs=st.lists(job(), min_size=1, max_size=8))
def test_every_request_streams_and_ends_as_without_it(pair, jobs):
    """Mixed requests (greedy and seeded, n forked past max_num_seqs, stop strings and
    stop token ids, min_tokens, logprobs, every output kind) arriving at different
    steps, through preemption: each request's outputs, streamed and final, are the
    synchronous engine's."""
    run = next(run_ids)
    named = [(f"{run}-{i}", p, params, at) for i, (p, params, at) in enumerate(jobs)]
    (sync, sync_values), (later, later_values) = (drive(engine, named) for engine in pair)
    assert later.keys() == sync.keys() == {rid for rid, *_ in named}
    for rid in sync:
        assert later[rid] == sync[rid], rid
        assert later_values.get(rid) == pytest.approx(sync_values.get(rid), abs=1e-4), rid


def test_first_tokens_and_ends_come_at_once_the_rest_a_step_late(path):
    """What a caller waits on is not delayed: a request's first token and its end (here:
    max_tokens) come from the step that sampled them, as without async output; the
    tokens between come from the step after (their text made during its forward)."""
    delta = RequestOutputKind.DELTA
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, output_kind=delta)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, output_kind=delta)
    arrivals = []
    for later in (None, "async_output_proc"):
        engine = make(path, later)
        engine.add_request("five", {"prompt_token_ids": [5, 17, 99]}, params)
        engine.add_request("one", {"prompt_token_ids": [6, 18]}, one)
        seen, step = [], 0
        while engine.has_unfinished_requests():
            seen += [(o.request_id, step, len(o.outputs[0].token_ids)) for o in engine.step()]
            step += 1
        arrivals.append(seen)
    assert arrivals[0] == [("five", 0, 1), ("one", 0, 1)] + [("five", s, 1) for s in (1, 2, 3, 4)]
    assert sorted(arrivals[1]) == [("five", s, 1) for s in (0, 2, 3, 4, 4)] + [("one", 0, 1)]


@MODES
def test_a_stop_string_gives_back_the_token_computed_after_it(path, mode):
    """A stop string is known one step late: the sequence ran in the next step too. Its
    tenant's counter is given that chunk back: at the same tokens of a request still
    running, both tenants' counters equal the synchronous engine's."""
    stopper = SamplingParams(temperature=0.0, max_tokens=40, stop=STOPS, min_tokens=1)
    long = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    counters, stopped = [], []
    for later in (None, mode):
        engine = make(path, later)
        engine.add_request("long-a", {"prompt_token_ids": [5, 6, 7]}, long, tenant="a")
        engine.add_request("long-b", {"prompt_token_ids": [9, 8, 7]}, long, tenant="b")
        for i in range(4):
            prompt = {"prompt_token_ids": [11 + i, 40, 77]}
            engine.add_request(f"stop-{i}", prompt, stopper, tenant="a")
        done = {}
        seq = engine.requests["long-a"].seqs[0]
        while seq.num_output_tokens < 30:
            done.update({o.request_id: o for o in engine.step() if o.finished})
        counters.append(dict(engine.scheduler.ledger.counters))
        for entry in engine._in_flight.entries if engine._in_flight else ():
            counters[-1][entry.item.seq.request.tenant] -= entry.item.charge  # its next
        while engine.has_unfinished_requests():
            done.update({o.request_id: o for o in engine.step() if o.finished})
        stopped.append({rid: done[rid].outputs[0].stop_reason for rid in done if "stop" in rid})
    assert stopped[0] == stopped[1]
    assert sum(reason in STOPS for reason in stopped[0].values()) >= 2  # ended by text
    assert counters[1] == pytest.approx(counters[0])


@MODES
@pytest.mark.parametrize("kind", [RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE])
def test_an_aborted_request_ends_with_all_its_text(path, kind, mode):
    """An abort between steps makes the outputs still deferred first: the aborted
    request's last output holds the text of every token it has, as the tokenizer decodes
    them, and the tokens the synchronous engine has at the same step."""
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, output_kind=kind)
    got = []
    for later in (None, mode):
        engine = make(path, later)
        engine.add_request("x", {"prompt_token_ids": [5, 17, 99]}, params)
        outs = [o for _ in range(6) for o in engine.step()]
        engine.abort_request("x")
        outs += engine.step()
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
        assert outs[-1].outputs[0].finish_reason == "abort"
        assert not engine.has_unfinished_requests()
        ids = [t for o in outs for t in o.outputs[0].token_ids]
        text = "".join(o.outputs[0].text for o in outs)
        if kind == RequestOutputKind.CUMULATIVE:
            ids, text = list(outs[-1].outputs[0].token_ids), outs[-1].outputs[0].text
        assert text == engine.tokenizer.decode(ids, skip_special_tokens=True)
        got.append(ids)
    assert got[0] == got[1] and len(got[0]) == 6  # a token a step, the prefill's first


@MODES
def test_a_stop_string_on_the_last_allowed_token_ends_as_a_stop(path, mode):
    """The token that reaches max_tokens also completes a stop string: the stop string
    wins (vLLM's order of checks), though its text is known only after the length."""
    free = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    (whole,) = drive(make(path, None), [("free", [5, 17, 99], free, 0)])[0]["free"][-1][2]
    stop = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, stop=[whole[1]])
    jobs = [("s", [5, 17, 99], stop, 0)]
    for later in (None, mode):
        (final,) = drive(make(path, later), jobs)[0]["s"][-1][2]
        assert final[2] == whole[2] and final[1] == ""
        assert (final[3], final[4]) == ("stop", whole[1])


PET = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


@MODES
def test_structured_outputs_advance_their_grammar_before_the_next_step(path, mode):
    """A grammar's state follows each token at once (the next step's mask needs it):
    constrained requests, greedy and forked, validate and equal the synchronous ones."""
    constraint = StructuredOutputsParams(json=PET)
    jobs = [
        ("g", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=150), 0),
        ("s", [9, 8], SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=150), 1),
        ("plain", [4, 4, 4], SamplingParams(temperature=0.0, max_tokens=20, stop=["e"]), 0),
    ]
    jobs = [
        (rid, p, params if rid == "plain" else _guided(params, constraint), at)
        for rid, p, params, at in jobs
    ]
    (sync, _), (later, _) = drive(make(path, None), jobs), drive(make(path, mode), jobs)
    assert later == sync
    for rid in ("g", "s"):
        for completion in later[rid][-1][2]:
            assert completion[3] == "stop"
            jsonschema.validate(json.loads(completion[1]), PET)


def _guided(params: SamplingParams, constraint) -> SamplingParams:
    params.structured_outputs = constraint
    return params
