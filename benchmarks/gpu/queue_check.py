"""Section 5: one ``lorapool worker`` on the device, fed through a Redis-compatible server.

The in-process engine runs the workload first (``queue_requests`` requests,
the base model and ``queue_adapters`` adapters in turn, greedy, top-5 logprobs)
and gives the expected tokens and logprobs and the engine-alone tokens/s. Then a
private server starts from a binary (``server.py``), one ``lorapool worker``
process with the same engine options serves it, and a producer submits the same
requests in one round trip. Both sides run in float32, yet the worker's batches
form as requests arrive, and another batch shape can sum in another order
(cuBLAS picks its kernel by shape): on a GPU a near tie may then go the other
way, as vLLM's own tests allow. So the checks are: every result equal to the
engine's up to near ties (each side's token among the other's top 5 where they
part; the exact count is reported), and the worker's logprobs within a tenth of
what serving a request with the wrong adapter moves them (measured in the same
run on ``PROBES`` requests), so an adapter mixed up, mis-scaled or left out
cannot pass as rounding. The worker's tokens/s (submit to the last result, both
warmed up on the whole workload at 2 tokens) is reported against the engine alone.

Then the worker's speed, fairly (issue 47): a second worker runs the workload as
it serves in production (the engine's default dtype, bf16 on CUDA; CUDA graphs;
no logprobs), and the engine alone runs it under the same settings (the
worker's CPU threads, its heap settings (``lorapool.heap.quiet``), DELTA outputs,
the same dtype and graphs), timing each ``step``:
``queue_overhead = 1 - sum of the engine's step times / the worker's wall time``
(submit to the last result), the share of the worker's time spent outside the
engine's steps: reading, admitting, publishing, waiting.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from . import models, oracle
from .parity import TOP_K
from .server import Server, find_binary

PREFIX = "gpukit"
PROBES = 8  # requests run again with a wrong adapter: what a mix-up moves


def run(ctx, rec) -> None:
    sizes = ctx.sizes
    shape = sizes.models[0]
    path, hf = models.build_model(shape, Path(ctx.workdir) / "models", ctx.device, load=False)
    oracle.free(hf)
    del hf
    adapters = models.adapters_for(
        path,
        shape,
        Path(ctx.workdir) / "tp-adapters",
        sizes.queue_adapters,
        (sizes.adapter_rank,),
        ctx.device,
    )
    names = [None, *adapters]
    which = [names[i % len(names)] for i in range(sizes.queue_requests)]
    prompts = models.prompts(sizes.queue_requests, 32, shape.vocab_size, seed=3)
    expected, engine_tps, misroute = _in_process(ctx, path, prompts, which, adapters)
    oracle.free()  # the in-process engine's KV cache must be gone before the worker sizes its own
    if ctx.device == "cuda":
        free, total = torch.cuda.mem_get_info()
        rec.figure("free_GiB_before_worker", round(free / 2**30, 1))
    rec.figure("requests", len(prompts))
    rec.figure("engine_tokens_per_s", round(engine_tps, 1))
    rec.figure("misroute_logprob_gap_min", float(f"{misroute:.3g}"))
    binary = find_binary()
    if not rec.check("a server binary is installed", binary is not None, "see make gpu-wheels"):
        return
    server = Server(binary)
    rec.figure("server", f"{binary.name} {server.version()}")
    try:
        served = (prompts, which, adapters, expected)
        _through_worker(ctx, rec, server, path, served, engine_tps, misroute)
        if ctx.time_left() < 0:
            rec.cut_short("the worker-settings speed runs")
            return
        _speed(ctx, rec, server, path, served)
    finally:
        server.stop()


WORKER_GPU_SHARE = 0.5  # the worker's and the in-process engine's KV sizing on a GPU


def _engine_options(ctx) -> dict:
    """The in-process engine's options: those of the worker (``_start_worker``)."""
    sizes = ctx.sizes
    memory = {"kv_cache_memory": 64 << 20}
    if ctx.device == "cuda":
        memory = {"kv_cache_memory": None, "gpu_memory_utilization": WORKER_GPU_SHARE}
    return memory | dict(
        max_num_seqs=sizes.queue_requests,
        max_num_batched_tokens=max(2048, sizes.queue_requests),
        enable_lora=True,
        max_loras=sizes.queue_adapters,
        max_lora_rank=sizes.adapter_rank,
    )


def _params(ctx, tokens: int | None = None, logprobs: bool = True, delta: bool = False):
    from lorapool import RequestOutputKind, SamplingParams

    n = tokens or ctx.sizes.queue_tokens
    kind = RequestOutputKind.DELTA if delta else RequestOutputKind.CUMULATIVE
    return SamplingParams(
        temperature=0.0,
        max_tokens=n,
        ignore_eos=True,
        logprobs=TOP_K if logprobs else None,
        output_kind=kind,
    )


def _in_process(ctx, path, prompts, which, adapters):
    """The expected (tokens, logprobs) of each request, the engine's tokens/s, and the
    smallest logprob gap a wrong adapter makes on ``PROBES`` of the adapter requests,
    with the worker's CPU threads (``_start_worker``): the engine alone must not differ."""
    threads = torch.get_num_threads()
    torch.set_num_threads(_worker_threads())
    try:
        return _engine_alone(ctx, path, prompts, which, adapters)
    finally:
        torch.set_num_threads(threads)


def _engine_alone(ctx, path, prompts, which, adapters):
    from lorapool import LoRARequest

    ids = {name: i + 1 for i, name in enumerate(adapters)}

    def lora(name):
        return None if name is None else LoRARequest(name, ids[name], str(adapters[name]))

    loras = [lora(w) for w in which]
    engine = oracle.make_engine(path, ctx.device, "float32", **_engine_options(ctx))
    # warm-up at the workload's shapes: the first call of a kernel at a new shape compiles
    # it, and the worker, started after, finds Triton's on-disk cache filled by this one
    oracle.engine_greedy_outputs(engine, prompts, 2, loras, TOP_K, ignore_eos=True)
    t0 = time.perf_counter()
    expected = oracle.engine_greedy_outputs(
        engine, prompts, ctx.sizes.queue_tokens, loras, TOP_K, ignore_eos=True
    )
    seconds = time.perf_counter() - t0
    names = list(adapters)
    probes = [i for i, w in enumerate(which) if w is not None][:PROBES]
    wrong = [lora(names[(names.index(which[i]) + 1) % len(names)]) for i in probes]
    if len(names) == 1:
        wrong = [None] * len(probes)  # the base model is the only other choice
    moved = oracle.engine_greedy_outputs(
        engine, [prompts[i] for i in probes], ctx.sizes.queue_tokens, wrong, TOP_K, ignore_eos=True
    )
    gaps = [oracle.logprob_gap(*expected[i], *out) for i, out in zip(probes, moved)]
    del engine
    oracle.free()
    return expected, sum(len(ids) for ids, _ in expected) / seconds, min(gaps, default=0.0)


def _served(ctx, rec, server, path, served, fast: bool, tag: str = ""):
    """One worker (``fast``: the production settings, else float32 eager) serving the
    workload after a warm-up on it at 2 tokens: (results, seconds submit to last result)."""
    from lorapool.producer import Producer

    prompts, which, adapters, _ = served
    producer = Producer(server.url, prefix=PREFIX)
    for name, directory in adapters.items():
        producer.registry.add(name, str(directory))
    log = Path(ctx.workdir) / f"worker{tag}.log"
    worker = _start_worker(ctx, server.url, path, log, fast)
    try:
        t_start = time.time()
        _wait_worker(producer, worker, log, ctx.deadline)
        rec.figure(f"worker_start_s{tag}", round(time.time() - t_start, 1))
        logprobs = not fast
        warm = producer.submit_many(  # as the engine's warm-up: every request, 2 tokens
            [{"prompt_token_ids": p} for p in prompts], _params(ctx, 2, logprobs), which
        )
        for handle in warm:
            handle.result(timeout=max(5, ctx.deadline - time.time()))
        params = _params(ctx, None, logprobs)
        t0 = time.perf_counter()
        handles = producer.submit_many([{"prompt_token_ids": p} for p in prompts], params, which)
        got = [h.result(timeout=max(5, ctx.deadline - time.time())) for h in handles]
        seconds = time.perf_counter() - t0
    finally:
        _stop(worker)
    return got, seconds


def _through_worker(ctx, rec, server, path, served, engine_tps, moved):
    prompts, which, adapters, expected = served
    got, seconds = _served(ctx, rec, server, path, served, fast=False)
    outs = [(list(out.outputs[0].token_ids), out.outputs[0].logprobs) for out in got]
    tokens = [ids for ids, _ in outs]
    worker_tps = sum(map(len, tokens)) / seconds
    rec.figure("worker_tokens_per_s", round(worker_tps, 1))
    rec.figure("worker_over_engine", round(worker_tps / engine_tps, 3))
    theirs = [ids for ids, _ in expected]
    parted = oracle.agreement(tokens, theirs).first_diffs
    rec.figure("results_equal", f"{len(tokens) - len(parted)}/{len(tokens)}")
    if parted:
        rec.note(f"first differences (request, token): {parted[:20]}")
    real = oracle.not_near_ties(
        tokens,
        theirs,
        [oracle.tops_of(lps, TOP_K) for _, lps in outs],
        lambda i, pos: oracle.tops_of(expected[i][1], TOP_K)[pos],
    )
    rec.check(
        "every worker result equals the in-process engine's up to near ties "
        f"(each token in the other's top {TOP_K} where they part)",
        not real,
        "; ".join(real[:10]),
    )
    gap = max(oracle.logprob_gap(*mine, *want) for mine, want in zip(outs, expected))
    rec.figure("worker_logprob_max_diff", float(f"{gap:.3g}"))
    rec.check(
        "the worker's logprobs are the engine's within a tenth of what a wrong adapter moves",
        moved > 0 and gap <= moved / 10,
        f"worker against engine {gap:.3g}, a wrong adapter {moved:.3g}",
    )
    loras = {out.lora_request.lora_name if out.lora_request else None for out in got}
    rec.check("results name their adapters", loras == set(which), str(sorted(map(str, loras))))


def _start_worker(ctx, url: str, path, log: Path, fast: bool = False) -> subprocess.Popen:
    """``fast``: the engine's default dtype and CUDA graphs (as served), else float32 eager."""
    sizes = ctx.sizes
    cmd = [sys.executable, "-c", "from lorapool.cli.main import main; main()", "worker"]
    cmd += ["--model", str(path), "--device", ctx.device]
    cmd += ["--dtype", "auto", "--no-enforce-eager"] if fast else ["--dtype", "float32"]
    cmd += ["--redis-url", url, "--prefix", PREFIX, "--insecure-no-key"]
    cmd += ["--max-num-seqs", str(sizes.queue_requests), "--enable-lora"]
    cmd += ["--max-num-batched-tokens", str(max(2048, sizes.queue_requests))]
    cmd += ["--max-loras", str(sizes.queue_adapters), "--max-lora-rank", str(sizes.adapter_rank)]
    if ctx.device == "cuda":
        cmd += ["--gpu-memory-utilization", str(WORKER_GPU_SHARE)]
    else:
        cmd += ["--kv-cache-memory", str(64 << 20)]
    env = dict(os.environ, OMP_NUM_THREADS=str(_worker_threads()))
    env.pop("TRITON_INTERPRET", None)
    with open(log, "w") as out:  # cwd outside the checkout: its folders would shadow lorapool
        return subprocess.Popen(cmd, cwd=ctx.workdir, env=env, stdout=out, stderr=out)


def _speed(ctx, rec, server, path, served) -> None:
    """The worker against the engine alone, both with the worker's production settings."""
    prompts, which, adapters, _ = served
    threads = torch.get_num_threads()
    torch.set_num_threads(_worker_threads())
    try:
        steps_s, tokens = _engine_as_served(ctx, path, prompts, which, adapters)
    finally:
        torch.set_num_threads(threads)
    oracle.free()
    rec.figure("served_engine_steps_s", round(steps_s, 3))
    rec.figure("served_engine_tokens_per_s", round(tokens / steps_s, 1))
    got, seconds = _served(ctx, rec, server, path, served, fast=True, tag="_served")
    made = sum(len(out.outputs[0].token_ids) for out in got)
    rec.figure("served_worker_wall_s", round(seconds, 3))
    rec.figure("served_worker_tokens_per_s", round(made / seconds, 1))
    rec.figure("queue_overhead", round(1 - steps_s / seconds, 3))
    rec.check(
        "the served worker made every token the engine alone made",
        made == tokens,
        f"worker {made}, engine {tokens}",
    )


def _engine_as_served(ctx, path, prompts, which, adapters) -> tuple[float, int]:
    """(sum of step seconds, tokens) of the engine alone running the workload as the fast
    worker does: default dtype, graphs, DELTA outputs, no logprobs, the worker's heap."""
    from lorapool import LoRARequest, heap

    ids = {name: i + 1 for i, name in enumerate(adapters)}
    loras = [None if w is None else LoRARequest(w, ids[w], str(adapters[w])) for w in which]
    options = _engine_options(ctx) | {"enforce_eager": False}
    engine = oracle.make_engine(path, ctx.device, "auto", **options)

    def drive(tokens: int, tag: str) -> tuple[float, int]:
        params = _params(ctx, tokens, logprobs=False, delta=True)
        for i, (prompt, lora) in enumerate(zip(prompts, loras)):
            engine.add_request(f"{tag}{i}", {"prompt_token_ids": prompt}, params, lora_request=lora)
        spent, made = 0.0, 0
        while engine.has_unfinished_requests():
            t0 = time.perf_counter()
            outs = engine.step()
            spent += time.perf_counter() - t0
            made += sum(len(c.token_ids) for out in outs for c in out.outputs)
        return spent, made

    drive(2, "warm")  # as the worker's warm-up
    saved = heap.quiet()
    try:
        result = drive(ctx.sizes.queue_tokens, "run")
    finally:
        heap.restore(saved)
    engine = None  # noqa: F841 - the closure names it: rebind, then the caller frees
    return result


def _worker_threads() -> int:
    return int(os.environ.get("OMP_NUM_THREADS") or 1)


def _wait_worker(producer, worker, log: Path, deadline: float) -> None:
    while producer.redis.hlen(producer.keys.workers) < 1:
        if worker.poll() is not None:
            raise RuntimeError(f"the worker exited with {worker.returncode}: {_tail(log)}")
        if time.time() > deadline:
            raise RuntimeError(f"the worker did not start in time: {_tail(log)}")
        time.sleep(0.1)


def _stop(worker: subprocess.Popen) -> None:
    if worker.poll() is None:
        worker.send_signal(signal.SIGTERM)
        try:
            worker.wait(timeout=15)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()


def _tail(log: Path) -> str:
    try:
        return log.read_text()[-1500:]
    except OSError:
        return ""
