"""``held.merged``, the worker's join of one request's deltas of several steps into
one chunk, equals adding them in turn with ``RequestOutput.add(aggregate=True)`` (the
oracle, the general path), for random deltas: one completion (its fast path) or
several, with and without logprobs, metrics, errors and finish reasons."""

import copy

from hypothesis import given, settings
from hypothesis import strategies as st

from lorapool.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from lorapool.worker.held import merged

ids = st.lists(st.integers(0, 50_000), max_size=3)


@st.composite
def completion(draw, index):
    tokens = draw(ids)
    logprobs = draw(st.none() | st.just([{t: Logprob(-0.5, 1, "x")} for t in tokens]))
    return CompletionOutput(
        index,
        draw(st.text(max_size=4)),
        tokens,
        draw(st.none() | st.floats(-50, 0)),
        logprobs,
        draw(st.none() | st.sampled_from(["length", "stop"])),
        draw(st.none() | st.integers(0, 9)),
    )


@st.composite
def delta(draw, indices):
    outputs = [draw(completion(i)) for i in draw(indices)]
    metrics = draw(st.none() | st.builds(RequestMetrics, st.floats(0, 1e9)))
    return RequestOutput(
        "r",
        None,
        None,
        None,
        outputs,
        draw(st.booleans()),
        metrics,
        error=draw(st.none() | st.text(max_size=3)),
    )


same_one = st.just([0])
varied = st.lists(st.integers(0, 2), min_size=1, max_size=3, unique=True)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_merged_equals_adding_in_turn(data):
    indices = data.draw(st.sampled_from([same_one, varied]))
    outs = data.draw(st.lists(delta(indices), min_size=1, max_size=5))
    expected = copy.deepcopy(outs)
    for later in expected[1:]:
        expected[0].add(later, aggregate=True)
    assert merged(outs).to_dict() == expected[0].to_dict()
