"""Admission of a request whose n sequences cannot fit in the KV cache together (issue
31 row D): refused at add_request with an error naming n, instead of running for
minutes with most of its sequences waiting. The real engine, a cache of 24 blocks."""

import pytest

from lorapool.engine.config import EngineArgs
from lorapool.engine.llm_engine import LLMEngine
from lorapool.protocol import SamplingParams


@pytest.fixture(scope="module")
def engine(model):
    return LLMEngine.from_engine_args(EngineArgs(model=model, num_kv_blocks=24))


def test_n_sequences_that_cannot_fit_together_are_refused(engine):
    capacity = 24 * 16
    params = SamplingParams(n=8, max_tokens=64, ignore_eos=True)  # 8 x 64 > 384
    with pytest.raises(ValueError, match=r"n=8 sequences of up to 64 tokens .* only 384"):
        engine.add_request("too-many", {"prompt_token_ids": [1, 2, 3]}, params)
    assert not engine.has_unfinished_requests()
    fits = SamplingParams(n=4, max_tokens=(capacity - 3) // 4, ignore_eos=True)
    engine.add_request("fits", {"prompt_token_ids": [1, 2, 3]}, fits)
    done = []
    while engine.has_unfinished_requests():
        done += [o for o in engine.step() if o.finished]
    assert [len(c.token_ids) for c in done[0].outputs] == [fits.max_tokens] * 4
