"""Async output processing (``engine.async_output``) and async scheduling
(``engine.async_scheduling``): with either on, every request streams and ends as it does
without it. Async output makes the text and outputs of a request's tokens between its
first and its end during the next step; async scheduling queues the next step before a
greedy step's tokens are read back, and makes that step's outputs meanwhile.

Oracles: transformers' greedy tokens; the synchronous engine (itself checked against
transformers, PEFT and the sampler's references in the other engine tests) for what
transformers does not say (stop strings, forks, seeded draws, logprobs, streamed text);
the tokenizer's own decode for the text of an aborted request; the fair-share ledger
of the synchronous engine at the same tokens.
"""

from __future__ import annotations

import itertools
import json

import jsonschema
import pytest
from engine_runs import assert_matches_transformers, workload
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lorapool import EngineArgs, LLMEngine, RequestOutputKind, SamplingParams
from lorapool.records.structured import StructuredOutputsParams

KINDS = [RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY]
# frequent in the tiny byte-level tokenizer's decodes of a random model: stop strings
# that end requests mid-way, sometimes on the step's last allowed token
STOPS = ["a", "e", "o", " ", "t", "in", "er", "!!", "\n"]
_ids = itertools.count()


@pytest.fixture(scope="module")
def path(tiny_model_path):
    return tiny_model_path("llama")


ASYNC = ["async_output_proc", "async_scheduling"]  # EngineArgs' flags
MODES = pytest.mark.parametrize("mode", ASYNC, ids=["async_output", "async_sched"])


def make(path, mode: str | None, **kw) -> LLMEngine:
    """An engine with the flag ``mode`` on; None: the synchronous engine."""
    flags = {mode: True} if mode else {}
    return LLMEngine.from_engine_args(EngineArgs(model=str(path), **flags, **kw))


@pytest.fixture(scope="module", params=ASYNC, ids=["async_output", "async_sched"])
def pair(path, request):
    """The synchronous engine and an async one, small enough to preempt (28 blocks of 16
    tokens) and to make forks wait for slots (max_num_seqs 6)."""
    kw = {"num_kv_blocks": 28, "max_num_seqs": 6, "max_num_batched_tokens": 64}
    return make(path, None, **kw), make(path, request.param, **kw)


def drive(engine, jobs):
    """Add job i (prompt, params, step to arrive at) while stepping; every output each
    request streamed, in order: (finished, error, per completion (index, text, token
    ids, finish reason, stop reason, logprobs' tokens and ranks)), and apart, the
    logprob values (a batch of another size moves them by float ulps)."""
    engine.abort_request(list(engine.requests))  # a failed example's, while shrinking
    while engine.has_unfinished_requests():
        engine.step()
    streamed: dict[str, list] = {}
    values: dict[str, list] = {}
    pending, step = sorted(jobs, key=lambda j: j[3]), 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][3] <= step:
            rid, prompt, params, _ = pending.pop(0)
            engine.add_request(rid, {"prompt_token_ids": prompt}, params)
        for out in engine.step():
            rid = out.request_id
            completions = []
            for c in out.outputs:
                ranks = [{t: lp.rank for t, lp in d.items()} for d in c.logprobs or []]
                completions.append(
                    (c.index, c.text, list(c.token_ids), c.finish_reason, c.stop_reason, ranks)
                )
                values.setdefault(rid, []).append(c.cumulative_logprob or 0.0)
                values[rid] += [lp.logprob for d in c.logprobs or [] for lp in d.values()]
            streamed.setdefault(rid, []).append((out.finished, out.error, completions))
        # what finished leaves the scheduler in the step that gave it its last token
        assert all(seq.finish_reason is None for seq in engine.scheduler.running)
        step += 1
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not engine.requests and not engine._deferred and engine._in_flight is None
    return streamed, values


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
    run = next(_ids)
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


@st.composite
def device_job(draw):
    """A request whose steps async scheduling leaves in flight but for its min_tokens:
    greedy, or drawn on the device (seeded; temperature, top-k, min-p; n samples, left
    in flight once forked), no logprobs; aborted at a step or not."""
    prompt = draw(st.lists(st.integers(3, 511), min_size=1, max_size=40))
    max_tokens = draw(st.integers(1, 20))
    sampled = draw(st.booleans())
    params = SamplingParams(
        temperature=draw(st.sampled_from([0.7, 1.0, 1.3])) if sampled else 0.0,
        top_k=draw(st.sampled_from([-1, 20])) if sampled else -1,
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
    )
    return prompt, params, draw(st.integers(0, 6)), draw(st.none() | st.integers(0, 25))


def drive_aborting(engine, jobs):
    """``drive``'s, for jobs (rid, prompt, params, arrival step, abort step or None):
    each request's outputs in order, and the step calls that returned them."""
    streamed: dict[str, list] = {}
    pending, step = sorted(jobs, key=lambda j: j[3]), 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][3] <= step:
            rid, prompt, params, *_ = pending.pop(0)
            engine.add_request(rid, {"prompt_token_ids": prompt}, params)
        engine.abort_request([j[0] for j in jobs if j[4] == step and j[0] in engine.requests])
        for out in engine.step():
            got = [
                (c.index, c.text, list(c.token_ids), c.finish_reason, c.stop_reason)
                for c in out.outputs
            ]
            streamed.setdefault(out.request_id, []).append((out.finished, got))
        step += 1
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not engine.requests and engine._in_flight is None
    return streamed


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(jobs=st.lists(device_job(), min_size=1, max_size=8))
def test_steps_left_in_flight_stream_and_end_as_without_it(path, jobs):
    """Greedy and seeded sampled requests, n of them forked (most steps left in flight),
    some with min_tokens (those steps are not), stop strings and ids, arriving and
    aborted at different steps: each
    request streams and ends as in the synchronous engine, whose schedule this one
    keeps (room for every request: no preemption, no chunking; prefix caching names the
    blocks a step filled once its tokens are in)."""
    kw = {"max_num_seqs": 16, "max_num_batched_tokens": 512, "enable_prefix_caching": True}
    run = next(_ids)
    named = [(f"{run}-{i}", *job) for i, job in enumerate(jobs)]
    sync = drive_aborting(make(path, None, **kw), named)
    assert drive_aborting(make(path, "async_scheduling", **kw), named) == sync


@pytest.mark.parametrize(
    ("temperature", "n"), [(0.0, 1), (1.0, 1), (1.0, 3)], ids=["greedy", "sampled", "forked"]
)
def test_the_next_step_is_queued_before_this_ones_tokens_are_read(
    path, monkeypatch, temperature, n
):
    """A step's tokens (greedy, or drawn on the device at temperature 1, n samples once
    forked) are read back only after the next step's forward was queued (on a GPU the
    host packs and queues it while the device runs); its outputs come from the step()
    call after. The reads and forwards are counted in the engine's own order: forward 0,
    forward 1, read 0, forward 2, read 1, ... The step that forks n samples (their
    first tokens) reads back at once, as it must."""
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
    params = SamplingParams(temperature=temperature, seed=5, n=n, max_tokens=4, ignore_eos=True)
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
