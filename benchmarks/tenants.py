"""Two tenants in one worker's engine: one floods with n=64 jobs, the other sends
1-token completions one after another (issue 51 row 4, Build item 3).

The scheduler is the engine's own (``engine/scheduler.py``, ``engine/fair_share.py``,
the block manager), driven as ``LLMEngine.step`` drives it: requests of n samples fork
at their first token, a sequence ends at its max_tokens. The model's forward is a
stand-in at a GPU's step rate: a step lasts ``--step-ms`` plus ``--token-us`` per
batched token (defaults: 3 ms + 10 µs, about what the GPU kit measured for a ~1B
Llama's decode step on an H200 at batch 64, benchmarks/RESULTS.md), on a virtual
clock; the scheduler's own CPU time a step (with this driver's bookkeeping) is
measured and shown apart, as this machine's load would make it noise on the clock.

Per mode, fair share on (``fair``) and off (``fcfs``: first come, first served),
alternated ``--repeats`` times:

- the light tenant's latency over the run's light jobs (arrival to its token), p50
  and p99, against its figure alone (the light jobs with no flood);
- throughput: tokens generated (both tenants' samples) per second of the run.

    lorapool bench tenants [--flood-depth 8] [--seconds 3] [--repeats 3] [--json out]
"""

from __future__ import annotations

import argparse
import itertools
import json
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


def run(args, fair: bool, flood: bool) -> dict:
    """One run of ``--seconds`` on the virtual clock, the light tenant sending a job
    ``--light-gap-ms`` after its previous one ended; with ``flood``, the
    flooding tenant keeps ``--flood-depth`` jobs in the engine all along (a new one as
    soon as one ends: back to back)."""
    sched = Scheduler(
        SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            fair_share=fair,
        ),
        BlockManager(args.num_blocks, 16),
    )
    now, generated, cpu_s, flood_done, steps = 0.0, 0, 0.0, 0, 0

    def add_flood():
        sched.add(request("flood", args.prompt, args.flood_tokens, args.n, now).seqs[0])

    for _ in range(args.flood_depth if flood else 0):
        add_flood()
    light_done, latencies = 0, []
    next_light_at, light = args.light_start_ms / 1000, None
    while now < args.seconds:
        if light is None and now >= next_light_at:
            light = request("light", args.prompt, 1, 1, now)
            sched.add(light.seqs[0])
        if not sched.has_unfinished():
            now = next_light_at
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
        spent = time.perf_counter() - start
        cpu_s += spent
        now += (args.step_ms + args.token_us / 1000 * out.num_batched_tokens) / 1000
        steps += 1
        for req in ended:
            if req.tenant == "light":
                latencies.append(now - req.arrival_time)
                light_done += 1
                light = None
                next_light_at = now + args.light_gap_ms / 1000
            else:
                flood_done += 1
                add_flood()
    return {
        "light_jobs": light_done,
        "light_p50_ms": 1000 * statistics.median(latencies),
        "light_p99_ms": 1000 * quantile(latencies, 0.99),
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
    parser.add_argument("--seconds", type=float, default=3.0, help="virtual seconds a run")
    parser.add_argument("--light-gap-ms", type=float, default=20.0)
    parser.add_argument("--light-start-ms", type=float, default=50.0)
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens of every job")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--num-blocks", type=int, default=4096, help="KV blocks of 16 tokens")
    parser.add_argument("--step-ms", type=float, default=3.0)
    parser.add_argument("--token-us", type=float, default=10.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    results = {"alone": [], "fcfs": [], "fair": []}
    for _ in range(args.repeats):  # alternated: alone, fcfs, fair, alone, ...
        results["alone"].append(run(args, fair=True, flood=False))
        results["fcfs"].append(run(args, fair=False, flood=True))
        results["fair"].append(run(args, fair=True, flood=True))
    med = {
        mode: {k: statistics.median(r[k] for r in runs) for k in runs[0] if runs[0][k] is not None}
        for mode, runs in results.items()
    }
    alone = med["alone"]
    print(f"{'mode':<6} {'light p50 ms':>12} {'p99 ms':>8} {'x alone p50/p99':>16} "
          f"{'tokens/s':>10} {'run s':>7} {'sched us/step':>13} {'preempt':>7}")  # fmt: skip
    for mode, m in med.items():
        ratio = f"{m['light_p50_ms'] / alone['light_p50_ms']:.2f}/"
        ratio += f"{m['light_p99_ms'] / alone['light_p99_ms']:.2f}"
        print(f"{mode:<6} {m['light_p50_ms']:>12.1f} {m['light_p99_ms']:>8.1f} {ratio:>16} "
              f"{m['tokens_per_s']:>10.0f} {m['seconds']:>7.2f} "
              f"{m['scheduler_us_per_step']:>13.0f} {m['preemptions']:>7.0f}")  # fmt: skip
    fair, fcfs = med["fair"], med["fcfs"]
    print(f"fair/fcfs throughput: {fair['tokens_per_s'] / fcfs['tokens_per_s']:.3f}")
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)},
                                         "runs": results, "median": med}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
