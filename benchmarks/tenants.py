"""Two tenants in one worker's engine: one floods with n=64 jobs, the other sends
1-token completions one after another (issue 51 row 4, Build item 3).

The scheduler is the engine's own (``engine/scheduler.py``, ``engine/fair_share.py``,
the block manager), driven as ``LLMEngine.step`` drives it: requests of n samples fork
at their first token, a sequence ends at its max_tokens. The model's forward is a
stand-in at a GPU's step rate, on a virtual clock: a step lasts ``--step-ms`` plus
``--token-us`` per decode token plus ``--prefill-us`` per prefill position (prompt or
recompute). Defaults, for the GPU kit's ~1B Llama on an H200 (benchmarks/RESULTS.md):
3 ms + 5 µs a decode token is 3.32 ms at batch 64, where the kit measured 3.17-3.30
ms; 10 µs a prefill position is built from the kit's prefill kernels (LoRA qkv at
h2048: 155-279 µs per layer for 1,000 tokens; attention: 140-146 µs per layer for
1,317 tokens) over 16 layers, 4-7 µs, plus the GEMMs' 2.2 GFLOP a token, 2.2-4.4 µs
at 100-50 % of the H200's ~989 dense bf16 TFLOPS. The scheduler's own CPU time a step
(with this driver's bookkeeping) is measured and shown apart, as this machine's
load would make it noise on the clock.

Modes, alternated ``--repeats`` times: ``alone`` (the light tenant, no flood),
``fcfs`` (first come, first served), ``uncapped`` (fair share, no contended prefill
cap) and ``fair`` (fair share with ``--contended-prefill-tokens``):

- the light tenant's latency (to its token), p50 and p99, against its figure alone,
  counted two ways: from the first step boundary after its arrival (``seen``: the
  step it runs in) and from its arrival (``arrival``: the step then in flight too,
  which was scheduled before it came; alone, the engine is idle and that is 0);
- throughput: tokens generated (both tenants' samples) per second of the run. By
  default the light tenant sends its next job when the last one ended, so a mode that
  serves it sooner also does more of its work (a prompt for one token each), and
  generated tokens fall for that alone; ``--light-every-ms`` fixes the work (both
  tenants' jobs the same in every mode), so throughput compares the same work's time.

    lorapool bench tenants [--flood-depth 8] [--seconds 3] [--repeats 3] [--json out]
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lorapool.engine.block_manager import BlockManager  # noqa: E402
from lorapool.engine.scheduler import Scheduler, SchedulerConfig  # noqa: E402
from lorapool.engine.sequence import Request, Sequence  # noqa: E402
from lorapool.protocol import SamplingParams  # noqa: E402

_ids = itertools.count()


def request(tenant: str, prompt: int, max_tokens: int, n: int, arrival: float) -> Request:
    params = SamplingParams(max_tokens=max_tokens, n=n)
    r = Request(f"{tenant}-{next(_ids)}", None, list(range(prompt)), params, arrival_time=arrival)
    r.max_tokens, r.tenant = max_tokens, tenant
    r.seqs.append(Sequence(next(_ids), r, 0, r.prompt_token_ids))
    return r


def run(args, mode: str, repeat: int = 0) -> dict:
    """One run on the virtual clock. By default ``--seconds`` long, the light tenant
    sending a job ``--light-gap-ms`` after its previous one ended; with ``flood``, the
    flooding tenant keeps ``--flood-depth`` jobs in the engine all along (a new one as
    soon as one ends: back to back). With ``--light-every-ms`` the work is fixed: light
    jobs come at that period until ``--seconds`` whatever the engine does, the flood
    starts ``--flood-jobs`` in all, and the run lasts until every job ended (its
    throughput is the same work over the time it took)."""
    flood = mode != "alone"
    fixed = args.light_every_ms is not None
    sched = Scheduler(
        SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            fair_share=mode != "fcfs",
            contended_prefill_tokens=None if mode == "uncapped" else args.cap,
            contended_window_steps=args.window,
        ),
        BlockManager(args.num_blocks, 16),
    )
    now, generated, cpu_s, steps = 0.0, 0, 0.0, 0
    flood_started, flood_done = 0, 0
    rng = random.Random(repeat)  # the same jobs in every mode of one repeat

    def add_flood():
        nonlocal flood_started
        if fixed and flood_started >= args.flood_jobs:
            return
        spread = round(args.flood_tokens * args.flood_jitter)
        tokens = args.flood_tokens + rng.randint(-spread, spread)
        sched.add(request("flood", args.prompt, tokens, args.n, now).seqs[0])
        flood_started += 1

    for _ in range(args.flood_depth if flood else 0):
        add_flood()
    latencies, seen, light_seen = [], [], {}
    # each repeat shifts the light tenant's phase against the flood's steps (the clock
    # is virtual: the same phase would repeat the same run)
    first = (args.light_start_ms + 1.7 * repeat) / 1000
    if fixed:
        every = args.light_every_ms / 1000
        arrivals = [first + k * every for k in range(int((args.seconds - first) / every) + 1)]
    else:
        arrivals = [first]
    arrivals.reverse()  # the next one at the end
    while (now < args.seconds or fixed) and (sched.has_unfinished() or arrivals or not fixed):
        while arrivals and now >= arrivals[-1]:
            light = request("light", args.prompt, 1, 1, arrivals.pop())
            light_seen[light.request_id] = now  # the first step boundary after it came
            sched.add(light.seqs[0])
        if not sched.has_unfinished():
            now = arrivals[-1]
            continue
        start = time.perf_counter()
        out = sched.schedule()
        sched.postprocess(out)
        ended = []
        for item in out.scheduled:
            if not item.samples:
                continue
            seq, req = item.seq, item.seq.request
            targets = [seq]
            if req.params.n > 1 and len(req.seqs) == 1:
                for index in range(1, req.params.n):
                    child = Sequence(next(_ids), req, index, req.prompt_token_ids)
                    req.seqs.append(child)
                    sched.fork(seq, child)
                    targets.append(child)
            for target in targets:
                target.append_token(7)
                generated += 1
                if target.num_output_tokens >= req.max_tokens:
                    sched.finish(target)
                    if len(req.seqs) == req.params.n and all(s.is_finished for s in req.seqs):
                        ended.append(req)
        cpu_s += time.perf_counter() - start
        prefill = sum(
            i.num_new_tokens
            for i in out.scheduled
            if i.num_new_tokens > 1 or i.start < i.seq.num_prompt_tokens
        )
        decode = out.num_batched_tokens - prefill
        now += (args.step_ms + (args.token_us * decode + args.prefill_us * prefill) / 1000) / 1000
        steps += 1
        for req in ended:
            if req.tenant == "light":
                latencies.append(now - req.arrival_time)
                seen.append(now - light_seen.pop(req.request_id))
                if not fixed:
                    arrivals.append(now + args.light_gap_ms / 1000)
            else:
                flood_done += 1
                add_flood()
    return {
        "light_jobs": len(latencies),
        "light_p50_ms": 1000 * statistics.median(latencies),
        "light_p99_ms": 1000 * quantile(latencies, 0.99),
        "seen_p50_ms": 1000 * statistics.median(seen),
        "seen_p99_ms": 1000 * quantile(seen, 0.99),
        "tokens_per_s": generated / now,
        "flood_jobs_done": flood_done,
        "seconds": now,
        "scheduler_us_per_step": 1e6 * cpu_s / max(1, steps),
        "preemptions": sched.num_preemptions,
    }


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flood-depth", type=int, default=8, help="flood jobs in the engine")
    parser.add_argument("--n", type=int, default=64, help="samples per flood job")
    parser.add_argument("--flood-tokens", type=int, default=30, help="max_tokens per sample")
    parser.add_argument(
        "--flood-jitter",
        type=float,
        default=0.0,
        help="each flood job's max_tokens drawn within this share of --flood-tokens either "
        "side (seeded by the repeat): jobs that do not end in lockstep",
    )
    parser.add_argument("--seconds", type=float, default=3.0, help="virtual seconds a run")
    parser.add_argument("--light-gap-ms", type=float, default=20.0)
    parser.add_argument("--light-start-ms", type=float, default=50.0)
    parser.add_argument(
        "--light-every-ms",
        type=float,
        help="fixed work: a light job every this many ms until --seconds (not after the "
        "last ended), the flood's --flood-jobs, each run until all ended",
    )
    parser.add_argument(
        "--flood-jobs", type=int, default=40, help="with --light-every-ms: flood jobs in all"
    )
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens of every job")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--num-blocks", type=int, default=4096, help="KV blocks of 16 tokens")
    parser.add_argument("--step-ms", type=float, default=3.0)
    parser.add_argument("--token-us", type=float, default=5.0, help="per decode token")
    parser.add_argument("--prefill-us", type=float, default=10.0, help="per prefill position")
    parser.add_argument(
        "--contended-prefill-tokens",
        dest="cap",
        type=int,
        default=128,
        help="the fair mode's cap (SchedulerConfig.contended_prefill_tokens; the worker's "
        "--tenant-prefill-cap, unset by default)",
    )
    parser.add_argument(
        "--contended-window-steps",
        dest="window",
        type=int,
        default=SchedulerConfig.contended_window_steps,
        help="SchedulerConfig.contended_window_steps",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    results = {"alone": [], "fcfs": [], "uncapped": [], "fair": []}
    for repeat in range(args.repeats):  # alternated: alone, fcfs, uncapped, fair, alone, ...
        for mode, runs in results.items():
            runs.append(run(args, mode, repeat))
    med = {
        mode: {k: statistics.median(r[k] for r in runs) for k in runs[0] if runs[0][k] is not None}
        for mode, runs in results.items()
    }
    alone = med["alone"]
    print(f"{'mode':<8} {'seen p50/p99 ms':>15} {'x alone':>11} {'arrival p50/p99 ms':>18} "
          f"{'x alone':>11} {'tokens/s':>8} {'x fcfs':>6} {'sched us/step':>13} "
          f"{'preempt':>7}")  # fmt: skip
    for mode, m in med.items():
        row = f"{mode:<8}"
        for kind, width in (("seen", 15), ("light", 18)):
            p50, p99 = m[f"{kind}_p50_ms"], m[f"{kind}_p99_ms"]
            ratio = f"{p50 / alone[f'{kind}_p50_ms']:.2f}/{p99 / alone[f'{kind}_p99_ms']:.2f}"
            row += f" {f'{p50:.1f}/{p99:.1f}':>{width}} {ratio:>11}"
        row += f" {m['tokens_per_s']:>8.0f} {m['tokens_per_s'] / med['fcfs']['tokens_per_s']:>6.3f}"
        print(row + f" {m['scheduler_us_per_step']:>13.0f} {m['preemptions']:>7.0f}")
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)},
                                         "runs": results, "median": med}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
