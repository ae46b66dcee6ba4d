"""Async output processing (``EngineArgs.async_output_proc``) and async scheduling
(``EngineArgs.async_scheduling``, ``--flags``) against the synchronous engine, with a
stand-in for an asynchronous device: what CPU can show of the overlap.

On a GPU the forward is queued and the host goes on until it reads the step's tokens
back. Here the model's forward (``ModelRunner._forward``) is replaced by a stand-in
device (``_paced_forward.QueuedDevice``): it returns zero logits at once and is busy
for ``--step-ms`` plus ``--token-us`` a token after it was handed the step (or after
its previous step, if that one was not done); the step's read-back (the greedy path's
``finite_argmax``, the sampler's results) waits until then (async scheduling's, until
the end of its own step: the next one is queued before it). Everything else (schedule,
batch packing, sampling's host work, detokenizing, stop checks, RequestOutputs) is the
engine's own work on this box's CPU. The defaults are ``benchmarks/tenants.py``'s step
of a ~1B Llama on an H200 (3 ms + 5 us a token).

Workload: ``--batch`` requests of 32 random prompt tokens, all decoding (DELTA
outputs, ``ignore_eos``), greedy or at ``--temperature`` (with ``--top-p``,
``--frequency-penalty``, and ``--logprobs`` asked or not); per run the median wall time
of ``--steps`` steps, off and each flag on alternated (``--pairs``), each run a fresh
engine in this process.

    python benchmarks/async_output.py --model DIR [--batch 64 256] [--temperature 1.0] \
        [--top-p 0.95] [--frequency-penalty 0.5] [--logprobs 2] \
        [--flags async_output_proc async_scheduling]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _paced_forward import QueuedDevice  # noqa: E402
from host_step import PROMPT_LEN, VOCAB, build_model  # noqa: E402


def run(model: str, batch: int, steps: int, sampling: dict, flag: str, device) -> dict:
    from lorapool import EngineArgs, LLMEngine, SamplingParams
    from lorapool.protocol import RequestOutputKind

    engine = LLMEngine.from_engine_args(
        EngineArgs(
            model=model,
            max_num_seqs=batch,
            max_num_batched_tokens=batch * PROMPT_LEN,
            **({flag: True} if flag != "off" else {}),
        )
    )
    params = SamplingParams(
        **sampling,
        max_tokens=steps + 40,
        ignore_eos=True,
        output_kind=RequestOutputKind.DELTA,
    )
    rng = random.Random(0)
    for i in range(batch):
        prompt = [rng.randrange(3, VOCAB) for _ in range(PROMPT_LEN)]
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    for _ in range(5):  # prefill, then a few decode steps
        engine.step()
    walls, outputs = [], 0
    device.busy = 0.0
    start = time.perf_counter()
    for _ in range(steps):
        t0 = time.perf_counter()
        outputs += len(engine.step())
        walls.append(time.perf_counter() - t0)
    total = time.perf_counter() - start
    return {
        "step_ms": round(statistics.median(walls) * 1e3, 3),
        "device_busy_share": round(device.busy / total, 3),
        "outputs_per_step": round(outputs / steps, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a model directory (default: a tiny one, built)")
    parser.add_argument("--batch", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--logprobs", type=int, default=None)
    parser.add_argument("--frequency-penalty", type=float, default=0.0)
    parser.add_argument("--step-ms", type=float, default=3.0)
    parser.add_argument("--token-us", type=float, default=5.0)
    parser.add_argument(
        "--flags",
        nargs="+",
        default=["async_output_proc"],
        choices=["async_output_proc", "async_scheduling"],
        help="EngineArgs flags each run on in turn, against all off",
    )
    parser.add_argument("--json", help="also write the report here")
    args = parser.parse_args()
    model = args.model
    if model is None:
        import tempfile

        model = build_model(Path(tempfile.mkdtemp()) / "tiny")
    torch.set_num_threads(1)  # the host's work on one core, as a GPU worker's Python
    device = QueuedDevice(args.step_ms / 1e3, args.token_us / 1e6)  # decode steps only
    device.install()
    report = {"args": vars(args), "device": "stand-in", "batches": {}}
    sides = ["off", *args.flags]
    sampling = {"temperature": args.temperature, "top_p": args.top_p, "logprobs": args.logprobs}
    sampling["frequency_penalty"] = args.frequency_penalty
    for batch in args.batch:
        runs = {side: [] for side in sides}
        for _ in range(args.pairs):
            for side in sides:
                got = run(model, batch, args.steps, sampling, side, device)
                runs[side].append(got)
                print(batch, side, json.dumps(got), flush=True)
        medians = {side: statistics.median(r["step_ms"] for r in runs[side]) for side in sides}
        report["batches"][batch] = {"runs": runs, "step_ms": medians}
        for side in args.flags:
            ratio = round(medians[side] / medians["off"], 3)
            report["batches"][batch][f"{side}_over_off"] = ratio
            print(batch, f"step off {medians['off']} ms, {side} {medians[side]} ms: {ratio}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
