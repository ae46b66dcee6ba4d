"""The benchmark's engine stand-in (benchmarks/queue_gpu.py, also the queue tests'
engine) admits as the real engine does: through the same adds, steps and aborts, its
``capacity()`` equals ``LLMEngine.capacity()`` of the tiny model (one sequence a
request, a KV cache with room for all), so ``bench queue-path`` models a real worker's
reads."""

from standin import load

from lorapool.engine.config import EngineArgs
from lorapool.engine.llm_engine import LLMEngine
from lorapool.protocol import SamplingParams

MAX_NUM_SEQS = 4


def test_the_stand_in_takes_what_the_engine_takes(model):
    engine = LLMEngine.from_engine_args(
        EngineArgs(model=model, max_num_seqs=MAX_NUM_SEQS, num_kv_blocks=256)
    )
    stand_in = load().StandInEngine(MAX_NUM_SEQS, 0.0)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    seen, added = [], 0

    def add(count: int) -> None:
        nonlocal added
        for _ in range(count):
            for e in (engine, stand_in):
                e.add_request(f"r{added}", {"prompt_token_ids": [1, 2, 3]}, params)
            added += 1

    def compare() -> None:
        seen.append((engine.capacity(), stand_in.capacity()))
        assert seen[-1][0] == seen[-1][1], seen

    compare()  # empty: every slot
    add(1)
    compare()  # one waiting, the others free (the old stand-in said none)
    engine.step(), stand_in.step()
    add(2)
    compare()  # one running, two waiting
    engine.step(), stand_in.step()
    add(4)  # past max_num_seqs: three wait for a slot
    compare()
    engine.step(), stand_in.step()
    compare()
    for e in (engine, stand_in):
        e.abort_request(["r0", "r1", "r2", "r3"])
    compare()
    engine.step(), stand_in.step()
    compare()
    assert [c for c, _ in seen] == [4, 3, 1, 0, 0, 1, 1]


def test_a_stand_in_step_grows_with_the_prefill_it_runs():
    """A GPU's step grows with its prefill positions: the stand-in's does too (the
    prompts of the requests it admits, in that step), by ``prefill_s`` each."""
    stand_in = load().StandInEngine(4, 0.001, prefill_s=20e-6)
    params = SamplingParams(max_tokens=3)
    stand_in.add_request("long", {"prompt_token_ids": list(range(2000))}, params)
    stand_in.step()  # admits it: 1 ms + 2,000 x 20 µs
    stand_in.step()  # decodes only: 1 ms
    (s0, e0, *_), (s1, e1, *_) = stand_in.steps
    assert e0 - s0 >= 0.041 and e1 - s1 < 0.02, (e0 - s0, e1 - s1)
