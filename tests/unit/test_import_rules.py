"""DESIGN.md's import rules, checked on what each module really imports.

Each check imports the modules in a fresh interpreter and reads ``sys.modules``:
a producer must import without torch, the audit trail never imports torch, the
scheduler and block manager are plain Python, the torch-free data types of
``lorapool/`` (``protocol``, ``records.job``, ``lifecycle.keys``, ...) need only the
standard library, orjson and msgspec, the request's life on Redis needs no torch, the worker
needs no SQLAlchemy and the kernels no engine.
"""

import ast
import importlib.util
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[2]
GPU_STACK = {"torch", "triton", "transformers", "safetensors", "tokenizers", "numpy"}

PROBE = """
import importlib, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
print(" ".join(sorted({m.split(".")[0] for m in sys.modules} - set(sys.stdlib_module_names))))
"""


def imported(modules: list[str]) -> set[str]:
    """Top-level non-stdlib modules loaded by importing ``modules`` in a fresh interpreter."""
    run = subprocess.run(
        [sys.executable, "-c", PROBE, *modules], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    return set(run.stdout.split())


def submodules(package: str, skip: tuple[str, ...] = ()) -> list[str]:
    module = __import__(package, fromlist=["__path__"])
    names = [package]
    for info in pkgutil.walk_packages(module.__path__, prefix=f"{package}."):
        if not any(info.name.startswith(f"{package}.{s}") for s in skip):
            names.append(info.name)
    return names


def test_the_data_types_need_only_the_standard_library_orjson_and_msgspec():
    # these talk to Redis (redis-py is theirs; persistence asks it; batch runs RQ jobs;
    # the lifecycle's Redis side and readers, pool_metrics among them: each
    # checked below; startup waits for Redis)
    clients = (
        "cli",
        "embedded",
        "connection",
        "startup",
        "persistence",
        "batch",
        "lifecycle",
        "egress",
    )
    modules = [m for m in submodules("lorapool", skip=clients) if m.count(".") <= 1]
    modules += ["lorapool.lifecycle", "lorapool.lifecycle.keys"] + submodules("lorapool.records")
    assert {"lorapool.protocol", "lorapool.records.job", "lorapool.identity"} <= set(modules)
    # msgspec (and what it loads): the typed records (records.adapter, ...)
    allowed = {"lorapool", "orjson", "_distutils_hack"} | imported(["msgspec"])
    extra = imported(modules) - allowed
    assert not {m for m in extra if not m.startswith("_")}, extra


def test_the_lifecycle_imports_without_torch_sqlalchemy_or_the_cli():
    loaded = imported(submodules("lorapool.lifecycle"))
    assert "orjson" in loaded  # the probe really imported the lifecycle
    assert not loaded & (GPU_STACK | {"sqlalchemy", "click", "rich"})


def test_producers_import_without_torch_or_sqlalchemy():
    loaded = imported(submodules("lorapool.producer"))
    assert "redis" in loaded  # the probe really imported the producers
    assert not loaded & (GPU_STACK | {"sqlalchemy"})


def test_the_audit_trail_never_imports_torch_or_rendering():
    loaded = imported(submodules("lorapool.audit_db", skip=("migrations",)))
    assert "sqlalchemy" in loaded
    assert not loaded & (GPU_STACK | {"rich", "click"})  # tables are the CLI's business


def test_the_gateway_imports_without_torch_or_sqlalchemy():
    loaded = imported(submodules("lorapool.gateway") + ["lorapool.cli.serve", "lorapool.cli.keys"])
    assert {"fastapi", "redis"} <= loaded  # the probe really imported the gateway
    assert not loaded & (GPU_STACK | {"sqlalchemy"})


def test_batches_import_without_torch_sqlalchemy_or_a_web_framework():
    # lorapool.batch checks lines with lorapool.openai's parser and runs RQ jobs: the
    # batch service needs no gateway (issue 36 Build 2)
    loaded = imported(submodules("lorapool.batch") + submodules("lorapool.openai"))
    assert {"rq", "redis"} <= loaded  # the probe really imported the batch package
    assert not loaded & (GPU_STACK | {"sqlalchemy", "fastapi", "starlette", "uvicorn"})


def test_egress_needs_only_the_standard_library_and_h11():
    # beyond what importing the package loads (its data types: msgspec since the bounds)
    package = imported(["lorapool"])
    loaded = {m for m in imported(["lorapool.egress"]) - package if not m.startswith("_")}
    assert loaded == {"h11"}


HTTP_CLIENTS = {"urllib.request", "http.client", "httpx", "requests", "aiohttp", "urllib3"}


def test_every_outbound_http_call_goes_through_egress():
    """No module of the distribution but ``lorapool/egress.py`` imports an HTTP client
    (the egress module checks where a URL points before it connects)."""
    folders = ["lorapool", "gateway", "producer", "worker", "audit_db", "engine", "kernels"]
    for path in (p for folder in folders for p in (ROOT / folder).rglob("*.py")):
        if path == ROOT / "lorapool" / "egress.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            clients = {n for n in names if n in HTTP_CLIENTS or n.split(".")[0] in HTTP_CLIENTS}
            assert not clients, f"{path.relative_to(ROOT)} imports {clients}: use lorapool.egress"


def test_the_worker_never_imports_sqlalchemy_or_the_cli():
    loaded = imported(submodules("lorapool.worker"))
    assert "redis" in loaded  # the probe really imported the worker
    assert not loaded & {"sqlalchemy", "click", "rich"}


def names_imported(folder: Path) -> dict[str, set[str]]:
    """Read, not imported: file name -> the modules its import statements name (at any
    depth: a function's lazy import counts)."""
    found = {}
    for path in folder.glob("*.py"):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
            elif isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
        found[path.name] = names
    return found


@pytest.mark.parametrize(
    "folder, never",
    [
        # what a worker shares with producers lives in the lifecycle (issue 36 Build 2)
        ("worker", "lorapool.producer"),
        # a batch line is parsed and answered by lorapool.openai, as a gateway request is
        ("lorapool/batch", "lorapool.gateway"),
        ("lorapool/openai", "lorapool.gateway"),
        ("lorapool/openai", "lorapool.batch"),
    ],
)
def test_arrows_that_must_not_exist(folder, never):
    for name, names in names_imported(ROOT / folder).items():
        wrong = {n for n in names if n == never or n.startswith(f"{never}.")}
        assert not wrong, f"{folder}/{name} imports {wrong}"


def test_the_kernels_never_import_the_engine():
    # Read, not imported: which lorapool modules each kernel module names.
    for path in (ROOT / "kernels").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                assert not node.module.startswith("lorapool.engine"), f"{path.name}: {node.module}"
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
                assert not any(n.startswith("lorapool.engine") for n in names), path.name


@pytest.mark.parametrize("module", ["scheduler", "block_manager", "sequence"])
def test_scheduling_is_plain_python(module):
    assert not imported([f"lorapool.engine.{module}"]) & (GPU_STACK | {"redis", "sqlalchemy"})


PACKAGES = [
    "lorapool",
    "lorapool.cli",
    "lorapool.lifecycle",
    "lorapool.records",
    "lorapool.batch",
    "lorapool.openai",
    "lorapool.engine",
    "lorapool.engine.models",
    "lorapool.engine.lora",
    "lorapool.kernels",
    "lorapool.worker",
    "lorapool.producer",
    "lorapool.audit_db",
    "lorapool.gateway",
]


@pytest.mark.parametrize("package", PACKAGES)
def test_each_folder_says_what_it_is_for_and_what_it_may_import(package):
    # Read, not imported: the engine's packages need torch, this test does not.
    path = Path(importlib.util.find_spec(package).origin)
    docstring = ast.get_docstring(ast.parse(path.read_text()))
    assert docstring, f"{path} has no docstring"
    assert "may import" in docstring.lower(), f"{path}: say what the folder may import"


def test_every_package_of_the_distribution_is_checked():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    # alembic's migration scripts are packages of the audit trail's, run by alembic
    packages = set(pyproject["tool"]["setuptools"]["packages"])
    assert set(PACKAGES) == {p for p in packages if not p.startswith("lorapool.audit_db.migr")}
