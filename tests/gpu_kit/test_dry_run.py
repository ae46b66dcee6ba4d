"""The GPU proof kit's CPU dry run, ``lorapool bench gpu --device cpu --tiny``, as CI runs it.

The dry run runs the kit's code path on tiny shapes: the Triton kernels under
the interpreter (a section process started with TRITON_INTERPRET=1), the
engine on the CPU against transformers and PEFT, a ``lorapool worker`` process
through a Redis-compatible server started from a binary. It runs under an
import guard (``tests/support/kit_guard``) in every process it starts.

What that proves: every module the dry run imports, in the kit, its sections and
the worker, is in the standard library, lorapool's own, or belongs to a
distribution on the GPU machine's package list
(``benchmarks/gpu/gpu_machine_packages.txt``) or in the bundle
(``benchmarks/gpu/wheels.txt``), or to what those require as installed here
(the GPU machine's installation of them brings its own); a hard import of
anything else fails the run, and an optional one takes its "not installed" path.
What it does not prove: that the versions there (torch 2.11, transformers 5.17,
Python 3.12) behave as the ones here, nor what only the CUDA path imports (it
imports torch and triton alone: ``engine/cuda_graphs.py``, the pinned copies).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from kit_figures import FIGURES, SECTIONS

ROOT = Path(__file__).resolve().parents[2]
KIT = ROOT / "benchmarks" / "gpu_check.py"
GUARD = ROOT / "tests" / "support" / "kit_guard"


def _load_bundle():
    spec = importlib.util.spec_from_file_location("gpu_bundle", ROOT / "benchmarks/gpu/bundle.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bundle = _load_bundle()


def with_requirements(dists: set[str]) -> set[str]:
    """``dists`` and what they require (no extras), as installed here, transitively.

    A distribution the GPU machine has comes with what it needs there; here it may
    need others (a newer version's), which the guard must not count against lorapool.
    """
    todo, seen = list(dists), set(dists)
    while todo:
        try:
            requires = metadata.requires(todo.pop()) or []
        except metadata.PackageNotFoundError:
            continue
        for requirement in requires:
            if "extra ==" in requirement:
                continue
            name = bundle.normalize(re.split(r"[\s<>=!~;\[(]", requirement, maxsplit=1)[0])
            if name not in seen:
                seen.add(name)
                todo.append(name)
    return seen


def allowed_modules() -> set[str]:
    """Top-level modules of the GPU machine's distributions, the bundle's (and what they
    require) and lorapool's."""
    listed = (ROOT / "benchmarks/gpu/gpu_machine_packages.txt").read_text().splitlines()
    words = " ".join(line.split("#")[0] for line in listed).split()
    dists = with_requirements({bundle.normalize(w) for w in words} | set(bundle.wanted()))
    dists.add("lorapool")
    modules = {d.replace("-", "_") for d in dists}
    for module, owners in metadata.packages_distributions().items():
        if any(bundle.normalize(owner) in dists for owner in owners):
            modules.add(module)
    return modules | {"gpu", "gpu_check", "hostile_tenants", "hostile_attacks", "sitecustomize"}


def server_binary() -> str | None:
    """A Redis-compatible server for the queue section: the one the bundle carries."""
    from lorapool import embedded

    try:
        return embedded.server_executable()
    except RuntimeError:
        return None


def guarded_env(tmp_path: Path, extra_path: str | None = None) -> dict:
    allow = tmp_path / "allowed.txt"
    allow.write_text("\n".join(sorted(allowed_modules())))
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORAPOOL_TEST_")}
    env.pop("TRITON_INTERPRET", None)
    env.pop("REDIS_URL", None)
    paths = [p for p in (extra_path, str(GUARD), env.get("PYTHONPATH")) if p]
    env |= {
        "PYTHONPATH": os.pathsep.join(paths),
        "LORAPOOL_IMPORT_ALLOW": str(allow),
        "LORAPOOL_IMPORT_BLOCKED_LOG": str(tmp_path / "blocked.txt"),
        "OMP_NUM_THREADS": "1",
    }
    binary = server_binary()
    if binary:
        env["LORAPOOL_KIT_SERVER"] = binary
    return env


def run_kit(tmp_path: Path, env: dict, *args: str, timeout: float = 540):
    out = tmp_path / "report"
    cmd = [sys.executable, str(KIT), "--device", "cpu", "--tiny", "--out", str(out), *args]
    proc = subprocess.run(
        cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout
    )
    report = json.loads((out / "report.json").read_text()) if (out / "report.json").exists() else {}
    return proc, report, out


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    if server_binary() is None:
        pytest.skip("no Redis-compatible server binary (lorapool[embedded] or one on PATH)")
    tmp_path = tmp_path_factory.mktemp("gpu-kit")
    proc, report, out = run_kit(tmp_path, guarded_env(tmp_path))
    blocked = (tmp_path / "blocked.txt").read_text() if (tmp_path / "blocked.txt").exists() else ""
    return proc, report, out, blocked


def test_dry_run_passes_with_every_section_reported(dry_run):
    proc, report, out, blocked = dry_run
    log = (out / "kit.log").read_text() if (out / "kit.log").exists() else ""
    assert proc.returncode == 0, f"{proc.stderr[-3000:]}\n{log[-5000:]}"
    assert report["status"] == "ok"
    assert [s["name"] for s in report["sections"]] == SECTIONS
    for section in report["sections"]:
        assert section["status"] == "ok", section
        assert section["checks"] or section["name"] == "throughput", section
        missing = [f for f in FIGURES[section["name"]] if f not in section["figures"]]
        assert not missing, f"{section['name']} lacks {missing}: {section['figures']}"
    markdown = (out / "report.md").read_text()
    for i, name in enumerate(SECTIONS, 1):
        assert f"## {i}. {name}: ok" in markdown
    print(f"modules the guard refused (optional imports the run did without): {blocked!r}")


def test_dry_run_names_its_report_by_date_and_commit(dry_run):
    _, report, out, _ = dry_run
    named = out / f"{report['date']}-{report['commit']}.json"
    assert json.loads(named.read_text())["sections"] == report["sections"]
    assert (out / "configs" / "cpu.json").is_file()  # the sweep's winners, to commit per device
    assert "acceptance" in report and "throughput" in report["acceptance"]
    assert "Acceptance figures" in (out / "report.md").read_text()


def test_dry_run_measures_the_decode_step_fairly(dry_run):
    _, report, _, _ = dry_run
    sections = {s["name"]: s for s in report["sections"]}
    throughput = sections["throughput"]
    figures = throughput["figures"]
    for flag in ("fused_layer_kernels", "lora_live_work"):  # absent here until they land
        assert figures[f"flag_{flag}"] in ("present", "flag absent")
    for flag in ("async_scheduling", "async_output_proc"):  # the flag path, run
        assert figures[f"flag_{flag}"] == "present"
        assert figures[f"flag_{flag}_tokens_vs_off_base_b8"] == "8/8"
    # seeded draws at temperature 1, with top-p or not, left in flight: the tokens of
    # the engine without it (whose top-p reads back which rows its search settled)
    for label in ("sampled", "nucleus"):
        assert figures[f"flag_async_scheduling_tokens_vs_off_{label}_b8"] == "8/8"
        assert figures[f"flag_async_scheduling_on_over_off_{label}_b4"] > 0
    rows = throughput["tables"]["step_timeline"]
    assert {(r["label"], r["batch"]) for r in rows} >= {("base", 4), ("lora2", 8), ("lora4", 4)}
    for batch in (4, 8):  # the base model sampled at temperature 1 beside its greedy step
        for label in ("sampled", "nucleus"):
            for name in (f"decode_step_ms_{label}", f"step_{label}_over_greedy"):
                value = figures[f"{name}_b{batch}_eager"]
                assert isinstance(value, float) and value > 0, (name, batch, value)
    sampled = [r for r in rows if r["label"] in ("sampled", "nucleus")]
    assert {(r["label"], r["batch"]) for r in sampled} == {
        (label, b) for label in ("sampled", "nucleus") for b in (4, 8)
    }
    assert all(r["sample_ms"] > 0 for r in sampled), sampled  # it went through the sampler
    for row in rows:  # the phases add up to the step
        parts = sum(row[f"{p}_ms"] for p in ("schedule", "prepare", "execute", "sample"))
        parts += row["output_ms"] + row["other_ms"]
        assert abs(parts - row["step_ms"]) < 0.01 + 1e-3 * row["step_ms"], row
    gemm = figures["practical_floor_ms_b4"]
    assert gemm > 0 and figures["bytes_floor_ms_base_b4"] > 0
    for name in ("kernels", "throughput", "big", "sweep"):
        assert any("nothing compiled inside" in c["name"] for c in sections[name]["checks"])
    rows = sections["kernels"]["tables"]["cases"]
    assert all(r["samples"] >= 2 for r in rows if "us" in r)
    sweep = sections["sweep"]["tables"]["sweep"]
    assert {r["op"] for r in sweep} >= {"paged_attention"}
    assert all(r["old_us"] > 0 and r["new_us"] > 0 for r in sweep)


def test_the_parts_cover_every_section_within_8_minutes_each():
    spec = importlib.util.spec_from_file_location("gpu_plan", ROOT / "benchmarks/gpu/plan.py")
    plan = importlib.util.module_from_spec(spec)
    sys.modules["gpu_plan"] = plan  # dataclasses look their module up
    spec.loader.exec_module(plan)
    covered = {name for part in plan.PARTS.values() for name in part}
    assert covered == set(plan.SECTIONS)
    for part in plan.PARTS.values():
        assert sum(plan.FULL_BOXES[name] for name in part) + 30 <= 480, part


def test_dry_run_checks_what_it_reports(dry_run):
    _, report, _, _ = dry_run
    sections = {s["name"]: s for s in report["sections"]}
    kernels = sections["kernels"]
    assert kernels["figures"]["triton_mode"] == "interpreted"
    dtypes = {row["dtype"] for row in kernels["tables"]["cases"]}
    assert dtypes == {"float16", "bfloat16", "float32"}
    ops = {row["op"] for row in kernels["tables"]["cases"]}
    assert ops == {"lora", "attention", "write_kv_cache"}
    engine = sections["engine"]["figures"]
    assert engine["tiny-llama_fp32_exact"] == "3/3" and engine["tiny-qwen3_lora_exact"] == "3/3"
    assert engine["tiny-llama_lora_requests_changed_by_adapter"] >= 1  # adapters matter
    queue = sections["queue"]["figures"]
    assert queue["results_equal"] == "24/24"
    assert queue["misroute_logprob_gap_min"] > 0  # a wrong adapter shows in the logprobs
    assert queue["worker_logprob_max_diff"] <= queue["misroute_logprob_gap_min"] / 10
    tenants = sections["tenants"]["figures"]
    assert tenants["light_calls"]["alone"] > 0 and tenants["light_calls"]["attacked"] > 0
    in_order = tenants["attacked_latencies_ms"]  # a list a round, each call's time
    assert sum(map(len, in_order)) == tenants["light_calls"]["attacked"]
    refused = {"ref_chain": 400, "lark_chain": 400, "gbnf": 400, "tokenize": 413}
    for attack, status in {**refused, "n64": 200, "streams": 200}.items():
        assert tenants["hostile_answers"].get(f"{attack} {status}", 0) > 0, attack


FAULT = """
import lorapool.kernels.reference as reference
_expand = reference.lora_expand
def lora_expand(y, lora_b, slots, out, slice_widths=None):
    _expand(y, lora_b, slots, out, slice_widths)
    out.add_(0.5)  # a wrong result: the kit must say so and exit 1
reference.lora_expand = lora_expand
"""


def test_a_wrong_kernel_result_fails_the_run(tmp_path):
    fault = tmp_path / "fault"
    fault.mkdir()
    (fault / "sitecustomize.py").write_text(FAULT + (GUARD / "sitecustomize.py").read_text())
    env = guarded_env(tmp_path, extra_path=str(fault))
    proc, report, _ = run_kit(tmp_path, env, "--sections", "device,kernels", timeout=120)
    assert proc.returncode == 1, proc.stderr[-2000:]
    kernels = report["sections"][1]
    assert report["status"] == "fail" and kernels["status"] == "fail"
    failed = [c["name"] for c in kernels["checks"] if not c["ok"]]
    assert failed and all(name.startswith("lora ") for name in failed), failed


# In the worker's process only (started as ``python -c ... worker``): every adapter's
# scaling 0.8 of what its config says, a bug whose greedy tokens can still match.
MISSCALED = """
import sys
if "worker" in sys.argv:
    from lorapool.engine.lora import adapter as _adapter
    _scaling = _adapter.LoRAAdapter.scaling.fget
    _adapter.LoRAAdapter.scaling = property(lambda self: 0.8 * _scaling(self))
"""


def test_a_worker_that_misscales_its_adapters_fails_the_queue_section(tmp_path):
    if server_binary() is None:
        pytest.skip("no Redis-compatible server binary (lorapool[embedded] or one on PATH)")
    fault = tmp_path / "fault"
    fault.mkdir()
    (fault / "sitecustomize.py").write_text((GUARD / "sitecustomize.py").read_text() + MISSCALED)
    env = guarded_env(tmp_path, extra_path=str(fault))
    proc, report, _ = run_kit(tmp_path, env, "--sections", "device,queue", timeout=200)
    assert proc.returncode == 1, proc.stderr[-2000:]
    queue = report["sections"][1]
    assert queue["status"] == "fail", queue
    failed = [c["name"] for c in queue["checks"] if not c["ok"]]
    assert any(name.startswith("the worker's logprobs") for name in failed), failed
    figures = queue["figures"]
    assert figures["worker_logprob_max_diff"] > figures["misroute_logprob_gap_min"] / 10


@pytest.mark.parametrize(
    "module, allowed",
    [
        ("sqlalchemy", False),
        ("alembic", False),
        ("psycopg", False),
        ("orjson", True),
        ("fastapi", True),
    ],  # the bundle carries the gateway's for ``tenants``
)
def test_the_guard_refuses_what_the_gpu_machine_lacks(tmp_path, module, allowed):
    env = guarded_env(tmp_path)
    proc = subprocess.run(
        [sys.executable, "-c", f"import {module}"], env=env, capture_output=True, text=True
    )
    assert (proc.returncode == 0) == allowed, proc.stderr[-500:]
    if not allowed:
        assert f"No module named '{module}'" in proc.stderr
        assert module in (tmp_path / "blocked.txt").read_text()


def test_lorapool_needs_nothing_the_gpu_machine_and_the_bundle_lack():
    """Every requirement of lorapool and of its worker and gateway extras (pyproject.toml)
    is on the GPU machine's list or pinned in the bundle: a dependency added later must be
    too (the gateway's: the ``tenants`` section runs ``lorapool serve`` there)."""
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    listed = (ROOT / "benchmarks/gpu/gpu_machine_packages.txt").read_text().splitlines()
    have = {bundle.normalize(w) for w in " ".join(x.split("#")[0] for x in listed).split()}
    have |= set(bundle.wanted())
    extras = project["optional-dependencies"]
    needed = project["dependencies"] + extras["worker"] + extras["gateway"]
    names = {bundle.normalize(re.split(r"[\s<>=!~;\[(]", r, maxsplit=1)[0]) for r in needed}
    assert names - have == set()


def test_bundle_check_names_what_does_not_hold(tmp_path):
    (tmp_path / "redis-8.1.0-py3-none-any.whl").write_bytes(b"x")
    (tmp_path / "redis-8.0.0-py3-none-any.whl").write_bytes(b"x")
    (tmp_path / "orjson-3.13.0-cp311-cp311-manylinux_2_17_x86_64.whl").write_bytes(b"x")
    (tmp_path / "hiredis-3.5.0-cp312-cp312-macosx_11_0_arm64.whl").write_bytes(b"x" * 100)
    issues = bundle.problems(tmp_path, {"redis": "8.1.0", "rq": "3.0.0"})
    text = "\n".join(issues)
    assert "redis: 2 versions" in text
    assert "orjson-3.13.0-cp311" in text and "not for CPython 3.12" in text
    assert "not a Linux x86_64 wheel" in text
    assert "rq==3.0.0 is missing" in text
    assert bundle.problems(tmp_path, {}) and not bundle.problems(tmp_path / "empty", {})


def test_a_spent_budget_still_reports_and_exits_2(tmp_path):
    # 5.5 s: a section starts only with 5 s left, and the device section alone (an
    # interpreter, torch's import, the copy timing) takes more than 0.5 s, so the kernels
    # are skipped however fast the machine is
    env = guarded_env(tmp_path)
    proc, report, out = run_kit(tmp_path, env, "--sections", "device,kernels", "--budget-s", "5.5")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert report["status"] == "incomplete"
    device, kernels = report["sections"]
    assert device["status"] == "ok" and device["figures"]["copy_GBps"] > 0
    assert kernels["status"] in ("skipped", "timeout")
    assert "## 2. kernels: " in (out / "report.md").read_text()


def test_a_section_cut_short_by_its_time_box_is_no_pass(tmp_path):
    spec = importlib.util.spec_from_file_location("gpu_report", ROOT / "benchmarks/gpu/report.py")
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    rec = report.Recorder("kernels", tmp_path / "r.json")
    rec.check("a case", True)
    rec.cut_short("the fp32 cases")
    assert rec.finish()["status"] == "timeout"
    assert json.loads((tmp_path / "r.json").read_text())["status"] == "timeout"
    rec = report.Recorder("kernels", None)
    rec.check("a case", False, "err 1.0")
    rec.cut_short("the rest")
    assert rec.finish()["status"] == "fail"  # a wrong result outranks the time box


def test_tenants_gives_the_worker_a_quarter_of_the_cpus_this_process_may_use(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from gpu.tenants import placement

    assert placement([0, 1]) is None  # a small box: nothing placed (the dry run's case)
    assert placement(list(range(16))) == ([0, 1, 2, 3], list(range(4, 16)))
    assert placement(list(range(32, 41))) == ([32, 33], list(range(34, 41)))
