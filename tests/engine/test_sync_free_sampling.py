"""What a step that async scheduling leaves in flight samples with: ``Sampler.on_device``
reads nothing back from the device (on a GPU the host would wait for the step's forward
there, ending the overlap), and keeps the tokens the synchronous sampler draws. Top-p's
staged nucleus search reads back which rows it settled; its ``sync_free`` form sorts
each row whole and keeps the same tokens. Reads are counted by a dispatch mode on the
CPU (``support/host_reads.py``); the oracle for the kept tokens is the staged search,
itself checked against transformers' TopPLogitsWarper (test_sampler.py)."""

from __future__ import annotations

from unittest.mock import patch

import pytest
import torch
from host_reads import HostReads
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from lorapool.engine import warpers
from lorapool.engine.sampler import Sampler, SamplingRow
from lorapool.engine.sequence import PLACEHOLDER
from lorapool.engine.warpers import NEG_INF, TOP_P_CANDIDATES, top_p, warp
from lorapool.protocol import SamplingParams


@st.composite
def logit_rows(draw):
    """Rows of logits past the candidate stages (5,000 tokens) or not (300): peaked,
    flat (the nucleus past 4,096 candidates), with ties at the threshold, with -inf."""
    vocab = draw(st.sampled_from([300, TOP_P_CANDIDATES[-1] + 904]))
    num_rows = draw(st.integers(1, 5))
    seed = draw(st.integers(0, 2**31))
    g = torch.Generator().manual_seed(seed)
    scales = torch.tensor(draw(st.lists(st.sampled_from([0.01, 1.0, 8.0]), min_size=num_rows,
                                        max_size=num_rows))).unsqueeze(1)  # fmt: skip
    r = torch.randn(num_rows, vocab, generator=g) * scales
    if draw(st.booleans()):  # ties: values rounded to a coarse grid
        r = (r * 4).round() / 4
    if draw(st.booleans()):  # tokens removed before (top-k, a grammar)
        r[torch.rand(num_rows, vocab, generator=g) < 0.5] = NEG_INF
        r[:, 0] = 1.0
    ps = draw(st.lists(st.sampled_from([0.01, 0.5, 0.9, 0.95, 0.999]), min_size=num_rows,
                       max_size=num_rows))  # fmt: skip
    return r, ps


@settings(max_examples=60, deadline=None)
@given(case=logit_rows(), chunk=st.integers(1, 6))
def test_sync_free_top_p_keeps_the_staged_searchs_tokens_and_reads_nothing(case, chunk):
    """Its rows sorted ``chunk`` at a time (``TOP_P_SORT_BYTES``)."""
    r, ps = case
    staged, whole = r.clone(), r.clone()
    with HostReads(staged) as reads:
        top_p(staged, ps)
    assert reads.ops  # the staged search does read back (what the detector must see)
    workspace = chunk * warpers.SORT_BYTES_PER_TOKEN * r.shape[1]
    with patch.object(warpers, "TOP_P_SORT_BYTES", workspace), HostReads(whole) as reads:
        top_p(whole, ps, sync_free=True)
    assert reads.ops == []
    assert torch.equal(staged, whole)


class _Largest(TorchDispatchMode):
    """The largest tensor an op made (in-place ops' outputs are their inputs: left out)."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func._schema.name.endswith("_"):
            made = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
            self.bytes = max([self.bytes, *(t.numel() * t.element_size() for t in made)])
        return out


@pytest.mark.parametrize("sync_free", [False, True], ids=["staged", "sync-free"])
def test_rows_sorted_whole_are_sorted_a_chunk_at_a_time(sync_free):
    """The workspace of rows sorted whole is bounded (the engine's activation reserve
    holds ``TOP_P_SORT_BYTES``), whoever sends flat rows (a high temperature, top_p near
    1: the staged search's last stage sorts them all): 64 rows of 20,000 tokens, 4 rows
    a chunk, make no tensor larger than 4 rows of float64 (the staged search's 4,096
    candidates of each row aside), and keep the same tokens."""
    vocab = 20_000
    r = torch.randn(64, vocab) * 0.01  # flat: the nucleus past 4,096 candidates
    ps = [0.999] * 60 + [0.2] * 4  # some settled among the candidates
    want = r.clone()
    top_p(want, ps)  # one chunk: the whole batch
    workspace = 4 * warpers.SORT_BYTES_PER_TOKEN * vocab
    got = r.clone()
    with patch.object(warpers, "TOP_P_SORT_BYTES", workspace), _Largest() as largest:
        top_p(got, ps, sync_free)
    candidates = 0 if sync_free else 64 * TOP_P_CANDIDATES[-1] * 8
    mask = 64 * vocab  # what is removed: a bool a token, for all rows at once
    assert largest.bytes <= max(4 * vocab * 8, candidates, mask) < 64 * vocab * 8
    assert torch.equal(got, want)


def _rows(vocab: int) -> list[SamplingRow]:
    """A step of device-drawn rows: greedy, temperature alone, top-k, top-p, min-p, and
    all of them, seeded, as OpenAI clients send them."""
    cases = [
        dict(temperature=0.0),
        dict(temperature=1.0, seed=1),
        dict(temperature=0.7, top_k=20, seed=2, logprobs=0),
        dict(temperature=1.0, top_p=0.9, seed=3),
        dict(temperature=1.3, top_p=0.5, seed=4, logprobs=5),
        dict(temperature=0.8, min_p=0.05, seed=5),
        dict(temperature=0.9, top_k=50, top_p=0.95, min_p=0.02, seed=6),
        dict(temperature=0.0, logprobs=2),
    ]
    return [SamplingRow(SamplingParams(**c), [5, 6, 7], list(range(i))) for i, c in
            enumerate(cases)]  # fmt: skip


def test_a_step_drawn_on_the_device_reads_nothing_back_and_draws_the_same_tokens():
    """Tokens, and the logprobs of the rows that asked (copied back apart, read when the
    step lands), as the synchronous sampler gives them."""
    vocab = TOP_P_CANDIDATES[-1] + 904
    for seed in range(5):
        rows = _rows(vocab)
        logits = torch.randn(len(rows), vocab, generator=torch.Generator().manual_seed(seed))
        logits *= 3
        if seed == 4:
            logits[2, 7] = float("nan")  # a row that is not finite: -1, no logprobs
        want = [(r.token_id, r.logprob, r.top_logprobs) for r in Sampler([2])(logits, rows)]
        with HostReads(logits) as reads:
            tokens, logprobs = Sampler([2]).on_device(logits, rows)
        assert reads.ops == []
        got = tokens.tolist()
        asked = logprobs.results(got)
        assert [(t, *asked.get(i, (None, None))) for i, t in enumerate(got)] == want
        assert sorted(asked) == [i for i, (t, lp, _) in enumerate(want) if lp is not None]


def test_warp_reads_back_only_for_top_p_when_not_sync_free():
    """The other warpers never read back; the staged top-p does, the sync-free one not."""
    params = [SamplingParams(temperature=0.7, top_k=20, min_p=0.05)] * 2
    for p, sync_free, reads_back in [
        (params, False, False),
        ([SamplingParams(top_p=0.9)] * 2, False, True),
        ([SamplingParams(top_p=0.9)] * 2, True, False),
    ]:
        x = torch.randn(2, 500)
        with HostReads(x) as reads:
            warp(x, p, sync_free)
        assert bool(reads.ops) == reads_back, (p, sync_free, reads.ops)


def test_penalties_count_the_token_in_flight_and_read_nothing_back():
    """Rows with repetition, frequency and presence penalties, logit_bias and min_tokens,
    whose last token is not read back yet (``PLACEHOLDER``; ``pending`` holds it on the
    device): the tokens and logprobs the synchronous sampler draws from the same rows
    with that token in place. Each row's token in flight is made its best logit, so
    that a penalty that missed it would change the row's token."""
    cases = [
        dict(temperature=0.0, repetition_penalty=1.5),
        dict(temperature=1.0, seed=1, frequency_penalty=2.0),
        dict(temperature=0.8, seed=2, presence_penalty=2.0, logprobs=1),
        dict(temperature=0.0, logit_bias={5: 30.0}, frequency_penalty=1.0),
        dict(temperature=1.0, seed=4, min_tokens=9, repetition_penalty=1.2),
        dict(temperature=0.0, presence_penalty=1.0, logprobs=2),
    ]
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        logits = torch.randn(len(cases), 1000, generator=g) * 3
        outs = [torch.randint(3, 1000, (k,), generator=g).tolist() for k in range(2, 8)]
        for i, out in enumerate(outs):
            logits[i, out[-1]] = logits[i].max() + 1.0
        known = [SamplingRow(SamplingParams(**c), [5, 6, 7], o) for c, o in zip(cases, outs)]
        want = [(r.token_id, r.logprob, r.top_logprobs) for r in Sampler([2])(logits, known)]
        held = [
            SamplingRow(SamplingParams(**c), [5, 6, 7], [*o[:-1], PLACEHOLDER])
            for c, o in zip(cases, outs)
        ]
        pending = torch.tensor([o[-1] for o in outs])
        with HostReads(logits, pending) as reads:
            tokens, logprobs = Sampler([2]).on_device(logits, held, pending)
        assert reads.ops == []
        got = tokens.tolist()
        asked = logprobs.results(got)
        assert [(t, *asked.get(i, (None, None))) for i, t in enumerate(got)] == want
