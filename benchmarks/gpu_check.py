"""GPU proof kit: the engine, the kernels and the worker proven on a real GPU.

    lorapool bench gpu --part 1 --out DIR   # on a GPU: calls of at most 8 minutes
    lorapool bench gpu --part 2 --out DIR
    lorapool bench gpu --part 3 --out DIR   # the hostile tenant (issue 51)
    lorapool bench gpu --device cpu --tiny --out DIR   # the CPU dry run (CI), every section

Eight sections, in order, each in a process of its own with a time box, so that
an early stop still reports what came before (``benchmarks/gpu/plan.py`` sizes
them and splits them into ``PARTS``): device (versions, copy bandwidth), kernels
(Triton against the reference, bandwidth by graph replay), sweep (launch configs
of the LoRA and attention kernels, old against new, the winners written), engine
(greedy parity against transformers and PEFT), throughput (against transformers'
generate, adapters against the base model, the decode step at batch 64 and 256
against its bytes and GEMM floors with and without CUDA graphs and with each
engine flag on and off), big (the decode step of an 8B shape), queue (a
``lorapool worker`` against the engine alone, parity and then speed), tenants (issue
51's hostile tenant against a light one through a gateway, the worker on the device).

Writes DIR/report.json (and its copy DIR/<date>-<commit>[-part<N>].json, to commit
under benchmarks/gpu/reports/), DIR/report.md and DIR/kit.log after every section.
Exit status: 0 every check held, 1 a check failed (a wrong result), 2 a section
did not finish (error, time box) but nothing was wrong.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from gpu import report  # noqa: E402
from gpu.plan import FULL_BOXES, PARTS, SECTIONS, TINY_BOXES, Context  # noqa: E402

GRACE_S = 15  # after its deadline a section gets this long to stop before it is killed


MODULES = {  # section -> its module in benchmarks/gpu/, imported by that section alone
    "device": "device_info",
    "kernels": "kernel_check",
    "sweep": "sweep",
    "engine": "parity",
    "throughput": "throughput",
    "big": "big_model",
    "queue": "queue_check",
    "tenants": "tenants",
}


def section_module(name: str):
    return importlib.import_module(f"gpu.{MODULES[name]}")


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="gpu-report", help="directory for the reports")
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (the CPU dry run)")
    parser.add_argument("--budget-s", type=float, default=None, help="whole-run limit")
    parser.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated")
    parser.add_argument(
        "--part",
        choices=sorted(PARTS),
        help="one of the calls the full run is split into (plan.PARTS): its sections",
    )
    parser.add_argument("--workdir", default=None, help="models and adapters (default: temp)")
    parser.add_argument("--section", help=argparse.SUPPRESS)
    parser.add_argument("--context", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.part:
        args.sections = ",".join(PARTS[args.part])
    unknown = set(args.sections.split(",")) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}; choose from {', '.join(SECTIONS)}")
    return args


def main(argv=None) -> int:
    args = parse(argv)
    if args.section:
        return run_section(args.section, Path(args.context), Path(args.result))
    return run_all(args)


def run_section(name: str, context: Path, result: Path) -> int:
    """A section's own process: run it, recording into ``result`` as it goes."""
    ctx = Context.load(context)
    rec = report.Recorder(name, result)
    try:
        import torch

        if ctx.device == "cuda":
            torch.cuda.set_device(0)
        torch.manual_seed(0)
        section_module(name).run(ctx, rec)
        rec.finish()
    except Exception:
        rec.finish("error", traceback.format_exc())
    return 0


def run_all(args) -> int:
    device = args.device if args.device != "auto" else _auto_device()
    boxes = TINY_BOXES if args.tiny else FULL_BOXES
    wanted = args.sections.split(",")
    budget = args.budget_s or sum(boxes[name] for name in SECTIONS if name in wanted) + 30
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="lorapool-gpu-kit-"))
    start = time.time()
    meta = {
        "command": " ".join(["lorapool bench gpu", *sys.argv[1:]]),
        "commit": _commit(),
        "mode": f"{device}{' tiny' if args.tiny else ''}",
        "budget_s": budget,
        "date": time.strftime("%Y-%m-%d", time.gmtime(start)),
        "part": args.part or "",
    }
    sections, earlier = [], {}
    log = out / "kit.log"
    log.write_text("")
    for name in SECTIONS:
        if name not in wanted:
            continue
        left = start + budget - time.time()
        if left < 5:
            sections.append(_skipped(name, "no time left in the run's budget"))
        else:
            deadline = time.time() + min(boxes[name], left)
            ctx = Context(device, args.tiny, str(workdir), deadline, dict(earlier), str(out))
            result = _spawn(name, ctx, workdir, log)
            sections.append(result)
            earlier[name] = result.get("figures", {})
        meta["wall_s"] = round(time.time() - start, 1)
        report.write_reports(out, meta, sections)
        print(f"[gpu kit] {name}: {sections[-1]['status']} ({meta['wall_s']} s)", file=sys.stderr)
    if not args.workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    status = report.overall(sections)
    print(f"[gpu kit] {status}: {out / 'report.md'}", file=sys.stderr)
    return {"ok": 0, "fail": 1}.get(status, 2)


def _spawn(name: str, ctx: Context, workdir: Path, log: Path) -> dict:
    """Run one section in a fresh interpreter (its own Triton mode), killed at its deadline."""
    ctx_path, result = workdir / f"ctx-{name}.json", workdir / f"result-{name}.json"
    ctx.save(ctx_path)
    result.unlink(missing_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("TRITON_INTERPRET", None)
    if name in ("kernels", "sweep") and ctx.device == "cpu":  # Triton's mode: per process
        env["TRITON_INTERPRET"] = "1"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--section", name]
    cmd += ["--context", str(ctx_path), "--result", str(result)]
    with open(log, "a") as log_file:
        log_file.write(f"===== {name} =====\n")
        log_file.flush()
        proc = subprocess.Popen(
            cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        timed_out = False
        try:
            proc.wait(timeout=max(1.0, ctx.deadline - time.time()) + GRACE_S)
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        _reap_group(proc.pid)
    data = report.read_result(result, name)
    if timed_out:
        data["status"] = "timeout"
    elif data.get("status") == "running" or proc.returncode != 0:
        data["status"] = "error"
        data.setdefault("error", f"the section's process exited with {proc.returncode}")
    return data


def _reap_group(pgid: int) -> None:
    """Whatever the section left running (a worker, a server) goes with it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)


def _skipped(name: str, why: str) -> dict:
    return {"name": name, "status": "skipped", "figures": {}, "checks": [], "notes": [why]}


def _auto_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _commit() -> str:
    if os.environ.get("LORAPOOL_COMMIT"):  # the device's copy of the tree has no .git of ours
        return os.environ["LORAPOOL_COMMIT"]
    try:
        out = subprocess.run(
            ["git", "-C", str(HERE), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
        )
        return out.stdout.strip() or os.environ.get("LORAPOOL_COMMIT", "unknown")
    except (OSError, subprocess.SubprocessError):
        return os.environ.get("LORAPOOL_COMMIT", "unknown")


if __name__ == "__main__":
    sys.exit(main())
