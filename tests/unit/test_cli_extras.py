"""The CLI on an install without an extra: every command stays listed and says what to install.

The install is simulated by a ``sitecustomize`` that makes the extra's modules
unimportable in a fresh interpreter, exactly as when they were never installed.
"""

import subprocess
import sys
from pathlib import Path

import pytest

BLOCKER = """
import sys
from pathlib import Path

class _NotInstalled:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None

sys.meta_path.insert(0, _NotInstalled())
"""


def lorapool(tmp_path, blocked: set[str], *args: str) -> subprocess.CompletedProcess:
    (tmp_path / "sitecustomize.py").write_text(BLOCKER.format(blocked=blocked))
    code = "import sys; from lorapool.cli.main import main; sys.argv[0] = 'lorapool'; main()"
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"},
    )


@pytest.mark.parametrize(
    ("blocked", "args", "extra"),
    [
        (
            {"torch", "triton"},
            ["worker", "--model", "m", "--redis-url", "redis://127.0.0.1:1/0"],
            "worker",
        ),
        ({"sqlalchemy", "alembic"}, ["audit", "--db-url", "sqlite://", "verify"], "audit"),
    ],
)
def test_command_of_a_missing_extra_is_listed_and_names_the_extra(tmp_path, blocked, args, extra):
    listing = lorapool(tmp_path, blocked, "--help")
    assert listing.returncode == 0, listing.stderr
    assert args[0] in listing.stdout.split()
    assert "submit" in listing.stdout.split()  # producer-side commands are unaffected

    run = lorapool(tmp_path, blocked, *args)
    assert run.returncode == 1, run.stderr
    assert f"is not installed: pip install 'lorapool[{extra}]'" in run.stderr, run.stderr
    assert "Traceback" not in run.stderr


def test_a_bug_in_a_command_module_is_not_hidden(tmp_path):
    # Only a module an extra provides is explained away; any other import error surfaces.
    run = lorapool(tmp_path, {"orjson"}, "status")
    assert run.returncode != 0
    assert "orjson" in run.stderr and "Traceback" in run.stderr


def test_command_module_that_imports_an_extra_at_import_time_stays_listed(tmp_path):
    # A command module importing torch at module level (lorapool.engine.config does):
    # the listing shows it as unavailable with the extra, and running it says the same.
    (tmp_path / "sitecustomize.py").write_text(BLOCKER.format(blocked={"torch"}))
    code = (
        "import sys; from lorapool.cli import main as m; "
        "m.COMMANDS['engine-args'] = 'lorapool.engine.config:EngineArgs'; "
        "sys.argv[0] = 'lorapool'; m.main()"
    )
    env = {"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"}
    for args, code_expected, stream in ((["--help"], 0, "stdout"), (["engine-args"], 1, "stderr")):
        run = subprocess.run(
            [sys.executable, "-c", code, *args], capture_output=True, text=True, env=env
        )
        assert run.returncode == code_expected, run.stderr
        assert "lorapool[worker]" in getattr(run, stream)


def test_bench_from_an_installed_wheel_says_it_needs_a_source_checkout(tmp_path):
    root = Path(__file__).resolve().parents[2]
    wheels, site = tmp_path / "wheels", tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
    subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(root)],
        check=True,
        capture_output=True,
        cwd=tmp_path,
    )
    (wheel,) = wheels.glob("lorapool-*.whl")
    subprocess.run(
        [*pip, "install", "--no-deps", "--target", str(site), str(wheel)],
        check=True,
        capture_output=True,
    )
    code = "import sys; from lorapool.cli.main import main; sys.argv[0] = 'lorapool'; main()"
    run = subprocess.run(
        [sys.executable, "-c", code, "bench", "engine"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"},
    )
    assert run.returncode == 2, run.stderr
    assert "benchmarks need a source checkout of lorapool" in run.stderr
    assert str(site) not in run.stderr  # no path into the installed package's surroundings


def test_bench_lists_its_benchmarks_by_command_name(tmp_path):
    run = lorapool(tmp_path, set(), "bench", "no-such-benchmark")
    assert run.returncode == 2
    listed = run.stderr.split("have: ")[1]
    assert "queue" in listed and "queue_path" not in listed


def test_bench_name_help_is_the_scripts_own_help(tmp_path):
    run = lorapool(tmp_path, set(), "bench", "cpu_micro", "--help")
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("usage: cpu_micro.py")
    assert "{step,linear,lora}" in run.stdout
    own = lorapool(tmp_path, set(), "bench", "--help")
    assert own.returncode == 0 and "Usage: lorapool bench" in own.stdout
