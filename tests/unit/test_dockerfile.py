"""The Dockerfile and .dockerignore, checked without Docker (not installed here: no image
is built in CI; tests/support/dockerignore.py applies Docker's rules to the context).

- The context is the package's sources: the audit key, the virtual environment, caches,
  tests and git's data stay out wherever they lie; every file a COPY names goes in.
- Each image runs as a numeric non-root user; the gateway's installs no torch, the
  worker's the CUDA build (PyPI's), of the version the Makefile installs and pyproject
  allows; the Python of the base image is one pyproject allows.
- compose.yaml builds its services from these two targets.
"""

import re
import subprocess
from pathlib import Path

import pytest
import tomllib
import yaml
from dockerignore import excluded, read_patterns
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = (ROOT / "Dockerfile").read_text()
PATTERNS = read_patterns((ROOT / ".dockerignore").read_text())
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())

# what must never reach an image, as paths a checkout or a run may hold
NEVER = [
    "audit.key", "deploy/audit.key", "lorapool/audit.key", "a/b/c/tls.pem", ".env",
    "deploy/.env", ".env.production",
    ".venv/bin/python", ".venv/lib/python3.11/site-packages/torch/lib/libtorch_cpu.so",
    "lorapool/.venv/pyvenv.cfg", "venv/bin/python",
    "lorapool/__pycache__/settings.cpython-311.pyc", "engine/scheduler.pyc",
    ".pytest_cache/v/cache/lastfailed", ".ruff_cache/0.6/x", ".cache/lorapool/audit.key",
    "lorapool.egg-info/PKG-INFO", "build/lib/lorapool/__init__.py", ".whl/torch.whl",
    "tests/unit/test_deploy.py", "tests/support/deployment.py", "lorapool/tests/x.py",
    ".git/config", "audit.sqlite", "worker/audit.sqlite", "audit_log.json", "benchmarks/x.py",
    "deploy/examples/secrets.example.yaml", "docs/dashboard.png", "compose.yaml",
]  # fmt: skip


def stages() -> dict[str, list[str]]:
    """Each stage's name -> its instructions (continuation lines joined)."""
    text = re.sub(r"\\\n\s*", " ", DOCKERFILE)
    found, current = {}, None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.upper().startswith("FROM "):
            current = line.split()[-1]
            found[current] = []
        if current is not None:
            found[current].append(line)
    return found


def arg(name: str) -> str:
    (value,) = re.findall(rf"^ARG {name}=(\S+)$", DOCKERFILE, re.M)
    return value


def test_the_docker_rules_are_dockers():
    """The matcher against the examples of Docker's documentation (.dockerignore)."""
    rules = read_patterns("# comment\n*/temp*\n*/*/temp*\ntemp?\n")
    assert excluded("somedir/temporary.txt", rules) and excluded("somedir/temp", rules)
    assert excluded("somedir/subdir/temporary.txt", rules) and excluded("tempa", rules)
    assert not excluded("temporary.txt", rules) and not excluded("a/b/c/temp", rules)
    rules = read_patterns("*.md\n!README*.md\nREADME-secret.md\n")
    assert excluded("CHANGES.md", rules) and not excluded("README.md", rules)
    assert excluded("README-secret.md", rules) and not excluded("docs/CHANGES.md", rules)
    rules = read_patterns("**/*.go\n/root.txt\n")
    assert excluded("main.go", rules) and excluded("a/b/main.go", rules)
    assert excluded("root.txt", rules) and not excluded("a/root.txt", rules)
    assert excluded("dir/file", read_patterns("dir")) and not excluded("dirx", read_patterns("dir"))


@pytest.mark.parametrize("path", NEVER)
def test_what_must_never_reach_an_image_stays_out(path):
    assert excluded(path, PATTERNS), f"{path} would be sent to the Docker build"


def test_what_the_checkout_ignores_stays_out():
    """Whatever git ignores in this checkout (its .venv, an audit.key, caches) is left out
    of the context too, at any depth."""
    listed = subprocess.run(
        ["git", "ls-files", "--others", "--ignored", "--exclude-standard", "--directory"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    assert listed, "git lists nothing ignored: the check would pass vacuously"
    for path in listed:
        inside = f"{path.rstrip('/')}/x" if path.endswith("/") else path
        assert excluded(inside, PATTERNS), f"{inside} (ignored by git) would be sent"


def test_every_copied_source_is_sent_and_the_package_is_whole():
    tracked = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    sent = [f for f in tracked if not excluded(f, PATTERNS)]
    copied = set()
    for line in stages()["wheel"]:
        if line.startswith("COPY ") and "--from" not in line:
            copied |= set(line.split()[1:-1])
    for source in copied:
        assert any(f == source or f.startswith(f"{source}/") for f in sent), source
    roots = {d.split("/")[0] for d in PYPROJECT["tool"]["setuptools"]["package-dir"].values()}
    assert roots <= copied, roots - copied  # the wheel gets every folder of the package
    assert {"pyproject.toml", PYPROJECT["project"]["readme"]} <= copied
    assert "kernels/configs/" in " ".join(sent) or not (ROOT / "kernels/configs").exists()
    assert not [f for f in sent if f.startswith("tests/") or f.endswith(".key")]


@pytest.mark.parametrize("target", ["gateway", "worker"])
def test_each_image_runs_as_a_numeric_non_root_user(target):
    users = [line.split()[1] for line in stages()[target] if line.startswith("USER ")]
    assert users, f"{target} runs as root"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) != 0, users[-1]
    base = " ".join(stages()["base"])
    assert f"useradd --uid {uid} " in base  # a user with a home, not a bare number


def test_the_pins_match_pyproject_and_the_makefile():
    worker = " ".join(stages()["worker"])
    torch = arg("TORCH_VERSION")
    makefile = re.search(r"torch==([\w.+]+)", (ROOT / "Makefile").read_text()).group(1)
    assert torch == makefile
    (spec,) = [Requirement(r) for r in PYPROJECT["project"]["optional-dependencies"]["worker"]
               if Requirement(r).name == "torch"]  # fmt: skip
    assert spec.specifier.contains(torch)
    assert '"torch==${TORCH_VERSION}"' in worker and "+cpu" not in worker
    assert "download.pytorch.org/whl/cpu" not in worker  # PyPI's Linux torch is CUDA's
    python = re.match(r"python:(\d+\.\d+\.\d+)-", arg("PYTHON_IMAGE")).group(1)
    assert SpecifierSet(PYPROJECT["project"]["requires-python"]).contains(python)
    assert python.rsplit(".", 1)[0] == "3.12"


def test_the_gateway_image_carries_no_torch():
    gateway = " ".join(stages()["gateway"])
    extras = re.search(r"lorapool\[([\w,]+)\] @", gateway).group(1).split(",")
    assert "worker" not in extras and "gateway" in extras and "audit" in extras
    assert '! python -c "import torch"' in gateway  # the build fails if torch comes along
    worker = " ".join(stages()["worker"])
    assert re.search(r"lorapool\[worker\] @", worker)


def test_compose_builds_its_services_from_the_two_targets():
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    for name, service in compose["services"].items():
        if "build" not in service:
            continue
        want = "worker" if name == "worker" else "gateway"
        assert service["build"] == {"context": ".", "target": want}, name
        assert service["image"].split(":")[0] == {"worker": "lorapool-worker"}.get(want, "lorapool")
