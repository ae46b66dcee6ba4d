"""The sampler against independent oracles: transformers' logits processors and
warpers, torch.log_softmax, hand-computed penalties, and sampled frequencies."""

import math

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from lorapool.engine.logprobs import prompt_logprobs
from lorapool.engine.penalties import apply_penalties
from lorapool.engine.sampler import Sampler, SamplingRow, draw, seeded_uniform
from lorapool.engine.warpers import warp
from lorapool.protocol import SamplingParams

EOS = 2


def logits_for(rows: int, vocab: int, scale: float = 3.0, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g) * scale


def row(prompt=(5, 6, 7), output=(), seq_index=0, **params) -> SamplingRow:
    return SamplingRow(SamplingParams(**params), list(prompt), list(output), seq_index)


def hf_warp(scores: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """transformers' warpers in generate's order: temperature, top-k, top-p, min-p."""
    ids = torch.zeros(1, 1, dtype=torch.long)
    scores = TemperatureLogitsWarper(p.temperature)(ids, scores.clone())
    if p.top_k > 0:
        scores = TopKLogitsWarper(p.top_k)(ids, scores)
    if p.top_p < 1.0:
        scores = TopPLogitsWarper(p.top_p)(ids, scores)
    if p.min_p > 0:
        scores = MinPLogitsWarper(p.min_p)(ids, scores)
    return scores


WARP_CASES = [
    dict(temperature=0.7),
    dict(temperature=1.3, top_k=5),
    dict(temperature=1.0, top_k=40),
    dict(temperature=0.9, top_p=0.9),
    dict(temperature=1.5, top_p=0.5),
    dict(temperature=1.0, min_p=0.1),
    dict(temperature=0.8, top_k=50, top_p=0.8),
    dict(temperature=0.6, top_k=30, top_p=0.95, min_p=0.05),
    dict(temperature=2.0, top_p=0.99),  # flat: the nucleus is past the first candidates
]


@pytest.mark.parametrize("sync_free", [False, True], ids=["staged", "sync-free"])
@pytest.mark.parametrize("vocab", [1000, 10_000])
def test_warpers_match_transformers(vocab, sync_free):
    params = [SamplingParams(**case) for case in WARP_CASES]
    x = logits_for(len(params), vocab)
    ours = x.clone()
    warp(ours, params, sync_free)  # all rows at once, each with its own parameters
    for i, p in enumerate(params):
        expected = hf_warp(x[i : i + 1], p)[0]
        kept = torch.isfinite(expected)
        assert torch.equal(torch.isfinite(ours[i]), kept), WARP_CASES[i]
        torch.testing.assert_close(ours[i][kept], expected[kept])


def test_top_p_keeps_at_least_one_token():
    x = torch.tensor([[10.0, 0.0, 0.0, 0.0]])
    warp(x, [SamplingParams(top_p=0.01)])
    assert torch.isfinite(x).tolist() == [[True, False, False, False]]


def test_repetition_penalty_matches_transformers():
    x = logits_for(3, 50)
    rows = [
        row(prompt=[1, 4, 4, 9], output=[9, 11], repetition_penalty=1.3),
        row(prompt=[3], output=[], repetition_penalty=0.7),
        row(prompt=[1, 4], output=[20]),
    ]  # no penalty: untouched
    ours = apply_penalties(x, rows, [EOS])
    for i, r in enumerate(rows):
        ids = torch.tensor([list(r.prompt_token_ids) + list(r.output_token_ids)])
        expected = RepetitionPenaltyLogitsProcessor(r.params.repetition_penalty)(ids, x[i : i + 1])
        torch.testing.assert_close(ours[i], expected[0])


def test_presence_and_frequency_penalties_by_hand():
    x = logits_for(2, 30)
    rows = [
        row(prompt=[1, 2, 3], output=[4, 4, 4, 7], presence_penalty=0.5, frequency_penalty=0.25),
        row(prompt=[4], output=[], presence_penalty=1.0, frequency_penalty=1.0),
    ]
    ours = apply_penalties(x, rows, [EOS])
    expected = x.clone()
    expected[0, 4] -= 3 * 0.25 + 0.5
    expected[0, 7] -= 1 * 0.25 + 0.5  # prompt tokens 1, 2, 3 are not penalized
    torch.testing.assert_close(ours, expected)


def test_all_penalties_together_in_order():
    x = logits_for(1, 20)
    r = row(
        prompt=[3, 5],
        output=[5, 5, 8],
        repetition_penalty=2.0,
        presence_penalty=0.5,
        frequency_penalty=0.5,
    )
    ours = apply_penalties(x, [r], [EOS])[0]
    expected = x[0].clone()
    for t in (3, 5, 8):
        v = expected[t]
        expected[t] = v / 2.0 if v > 0 else v * 2.0
    expected[5] -= 2 * 0.5 + 0.5
    expected[8] -= 1 * 0.5 + 0.5
    torch.testing.assert_close(ours, expected)


def test_penalties_never_modify_the_input_and_skip_rows_without_them():
    x = logits_for(2, 20)
    before = x.clone()
    assert apply_penalties(x, [row(), row()], [EOS]) is x
    out = apply_penalties(x, [row(output=[1], presence_penalty=1.0), row()], [EOS])
    assert torch.equal(x, before) and torch.equal(out[1], x[1])


def test_greedy_is_argmax_of_the_penalized_logits():
    x = logits_for(4, 100)
    x[1, 17] = 50.0
    rows = [
        row(temperature=0),
        row(temperature=0, output=[17], repetition_penalty=100.0),
        row(temperature=1e-6),
        row(temperature=0, top_k=3, top_p=0.5),
    ]
    tokens = [r.token_id for r in Sampler([EOS])(x, rows)]
    expected = apply_penalties(x, rows, [EOS]).argmax(-1).tolist()
    assert tokens == expected
    assert tokens[1] != 17


def test_logprobs_are_the_raw_log_softmax():
    x = logits_for(3, 500, scale=4.0)
    rows = [
        row(temperature=0.5, top_k=3, repetition_penalty=1.5, output=[1, 2], logprobs=5),
        row(temperature=0),  # no logprobs asked
        row(temperature=0, logprobs=0),
    ]
    results = Sampler([EOS])(x, rows)
    expected = torch.log_softmax(x, dim=-1)
    for i in (0, 2):
        res = results[i]
        assert res.logprob == pytest.approx(expected[i, res.token_id].item(), abs=1e-4)
        chosen = res.top_logprobs[res.token_id]
        assert chosen.rank == int((expected[i] > expected[i, res.token_id]).sum()) + 1
        assert next(iter(res.top_logprobs)) == res.token_id  # the chosen token comes first
    top = results[0].top_logprobs
    values, ids = expected[0].topk(5)
    for rank, (tid, value) in enumerate(zip(ids.tolist(), values.tolist()), start=1):
        assert top[tid].rank == rank
        assert top[tid].logprob == pytest.approx(value, abs=1e-4)
    assert len(top) in (5, 6)
    assert results[1].logprob is None and results[1].top_logprobs is None
    assert list(results[2].top_logprobs) == [results[2].token_id]


def test_prompt_logprobs():
    prompt = [4, 9, 1, 7, 7]
    x = logits_for(len(prompt), 40)
    result = prompt_logprobs(x, prompt, k=3)
    expected = torch.log_softmax(x, dim=-1)
    assert len(result) == len(prompt) and result[0] is None
    for pos in range(1, len(prompt)):
        d = result[pos]
        token = prompt[pos]
        assert d[token].logprob == pytest.approx(expected[pos - 1, token].item(), abs=1e-5)
        assert set(expected[pos - 1].topk(3).indices.tolist()) <= set(d)
        assert len(d) <= 4
    assert prompt_logprobs(x[:1], [5], k=2) == [None]


def test_the_input_logits_are_never_modified():
    x = logits_for(3, 300)
    before = x.clone()
    Sampler([EOS])(
        x, [row(temperature=0.5, top_p=0.8), row(temperature=1.0, min_p=0.2), row(temperature=0.7)]
    )
    Sampler([EOS])(x[:1], [row(temperature=0.5)])
    assert torch.equal(x, before)


def sample_steps(sampler, logits_seq, make_rows, target):
    """Tokens of row ``target`` over several steps; each step's rows from make_rows(out)."""
    out = []
    for logits in logits_seq:
        rows = make_rows(out)
        out.append(sampler(logits, rows)[target].token_id)
    return out


def test_seeded_rows_are_the_same_alone_and_in_any_batch():
    vocab, steps = 2000, 12
    alone_logits = [logits_for(1, vocab, scale=1.0, seed=s) for s in range(steps)]
    params = dict(temperature=1.0, top_p=0.95, seed=1234)

    def alone(out):
        return [row(output=out, **params)]

    def busy(out):  # other rows, other params, the seeded row in the middle
        return [
            row(temperature=0.8),
            row(temperature=0, output=[3]),
            row(output=out, **params),
            row(temperature=1.2, top_k=5, seed=7),
            row(temperature=1.0, logprobs=2),
        ]

    busy_logits = []
    for s, one in enumerate(alone_logits):
        noise = logits_for(5, vocab, seed=100 + s)
        noise[2] = one[0]
        busy_logits.append(noise)
    first = sample_steps(Sampler([EOS], seed=0), alone_logits, alone, 0)
    again = sample_steps(Sampler([EOS], seed=99), alone_logits, alone, 0)
    batched = sample_steps(Sampler([EOS], seed=5), busy_logits, busy, 2)
    assert first == again == batched
    assert len(set(first)) > 1  # it really samples


def test_seeded_row_resumes_from_its_emitted_tokens():
    vocab = 500
    logits = [logits_for(1, vocab, scale=1.0, seed=s) for s in range(8)]
    params = dict(temperature=1.0, seed=42)
    full = sample_steps(Sampler([EOS]), logits, lambda out: [row(output=out, **params)], 0)
    # Another worker picks it up after 5 tokens: its sampler has never seen the request.
    resumed = list(full[:5])
    other = Sampler([EOS], seed=3)
    for step in range(5, 8):
        resumed.append(other(logits[step], [row(output=resumed, **params)])[0].token_id)
    assert resumed == full


def test_n_completions_of_a_seeded_request_differ():
    x = logits_for(1, 1000, scale=0.5).expand(4, -1)
    rows = [row(temperature=1.0, seed=9, seq_index=i) for i in range(4)]
    tokens = [r.token_id for r in Sampler([EOS])(x, rows)]
    assert len(set(tokens)) > 1


def test_unseeded_rows_differ_and_seeded_uniforms_are_pure():
    x = logits_for(1, 1000, scale=0.5).expand(8, -1)
    tokens = [r.token_id for r in Sampler([EOS])(x, [row(temperature=1.0)] * 8)]
    assert len(set(tokens)) > 1
    u = seeded_uniform(5, 1, 3)
    assert u == seeded_uniform(5, 1, 3) and 0 < u <= 1
    assert len({seeded_uniform(5, i, s) for i in range(3) for s in range(3)}) == 9
    assert 0 < seeded_uniform(-1, 0, 0) <= 1


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_masks_eos_and_stop_token_ids(temperature):
    vocab = 50
    x = torch.zeros(3, vocab)
    x[:, EOS] = 30.0
    x[:, 11] = 29.0
    x[:, 12] = 28.0
    p = dict(temperature=temperature, min_tokens=3, stop_token_ids=[11])
    rows = [
        row(output=[5, 5], **p),
        row(output=[5, 5, 5], **p),
        row(output=[5], ignore_eos=True, **p),
    ]
    tokens = [r.token_id for r in Sampler([EOS])(x, rows)]
    assert tokens[0] == 12  # EOS and the stop token are banned until 3 tokens
    assert tokens[1] == EOS  # min_tokens reached
    assert tokens[2] == 12  # vLLM bans EOS even with ignore_eos


def test_a_non_finite_row_asking_logprobs_fails_alone():
    """Its draw is garbage (past the vocabulary where it is padded to the draw's blocks):
    token -1, no logprobs, and the rows beside it keep theirs (before: the gather of its
    logprob raised, failing the whole step; on a GPU a device-side assert)."""
    rows = [row(temperature=0.7, seed=s, logprobs=2) for s in range(6)]
    x = logits_for(len(rows), 1000)
    alone = [Sampler([EOS])(x[i : i + 1], [r])[0] for i, r in enumerate(rows)]
    x[1:4, 7] = float("nan")
    x[4, 9] = float("inf")
    results = Sampler([EOS])(x, rows)
    assert [r.token_id for r in results[1:5]] == [-1] * 4
    assert all(r.logprob is None and r.top_logprobs is None for r in results[1:5])
    for i in (0, 5):
        assert results[i].token_id == alone[i].token_id
        assert results[i].top_logprobs.keys() == alone[i].top_logprobs.keys()


def test_draw_never_picks_a_removed_token():
    vocab = 700  # not a multiple of the block size
    r = torch.full((4, vocab), float("-inf"))
    allowed = [0, 255, 256, 699]
    for i, t in enumerate(allowed):
        r[i, t] = 0.0
    r[3, 1] = 0.0
    for u in (1e-300, 0.5, 1.0):
        tokens = draw(r.clone(), torch.full((4,), u, dtype=torch.float64)).tolist()
        assert tokens[:3] == allowed[:3] and tokens[3] in (1, 699)


def frequencies(sampler, x, rows_per_call, calls, params):
    counts = torch.zeros(x.shape[1])
    batch = x.expand(rows_per_call, -1)
    for _ in range(calls):
        for res in sampler(batch, [row(**params)] * rows_per_call):
            counts[res.token_id] += 1
    return counts


@pytest.mark.parametrize(
    "params",
    [
        dict(temperature=0.7),
        dict(temperature=1.0, top_p=0.8),
        dict(temperature=1.2, top_k=6, min_p=0.05),
    ],
)
def test_sampled_frequencies_follow_the_processed_distribution(params):
    vocab, n = 300, 40_000
    x = logits_for(1, vocab, scale=1.5, seed=3)
    x[0, :10] += 3.0  # a few likely tokens, in the first block
    x[0, 290:] += 2.5  # and a few in the last, partial block
    probs = torch.softmax(hf_warp(x, SamplingParams(**params)), dim=-1)[0].double()
    counts = frequencies(Sampler([EOS], seed=1), x, 400, n // 400, params).double()
    assert counts[probs == 0].sum() == 0
    expected = probs * n
    big = expected >= 5
    chi2 = float((((counts - expected) ** 2 / expected)[big]).sum())
    dof = int(big.sum()) - 1
    assert chi2 < dof + 6 * math.sqrt(2 * dof) + 10, (chi2, dof)
    assert float(counts[~big].sum()) == pytest.approx(float(expected[~big].sum()), abs=40)


def test_empty_batch_and_shape_mismatch():
    sampler = Sampler([EOS])
    assert sampler(torch.zeros(0, 10), []) == []
    with pytest.raises(ValueError):
        sampler(torch.zeros(2, 10), [row()])
