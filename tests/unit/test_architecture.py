"""The floors of the house, read from the source with ``ast`` (no import runs): which
room may name which (issue 50 Build 4; DESIGN.md's layout, each package's docstring).

- ``lorapool.records`` is the floor: every record that crosses Redis or HTTP. It names
  nothing above it (no lifecycle, gateway, worker, engine, openai, producer, batch,
  audit_db or CLI) and no client of a server (redis).
- ``lorapool`` root modules (settings, signing, identity, ...) stand beside it: they
  name no room above them either (the CLI, ``cli/``, is the top floor and names all).
- ``producer`` is the client SDK: it names no ``openai`` and no ``gateway``.
- the gateway names no torch (nor the engine, kernels or worker that bring it).
- the gateway's way into the pool (``pool.py``, ``pool_view.py``, and what they wait
  with: ``streams.py``, ``redis_watch.py``) names no ``openai``: it is pool access only,
  its failures facts (``NoWorker``, ``JobLost``, ``RedisAway``); OpenAI's policy and
  wording are ``openai.serving``'s and ``openai.admission``'s.

Every import counts, at any depth: a function's lazy import too.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ROOMS = ("lifecycle", "gateway", "worker", "engine", "kernels", "openai", "producer")
ABOVE = tuple(f"lorapool.{r}" for r in (*ROOMS, "batch", "audit_db", "cli"))


def imports_of(path: Path) -> set[str]:
    """The modules ``path``'s import statements name: ``from a.b import c`` names
    ``a.b`` and ``a.b.c`` (c may be a module); a relative import is refused."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: a relative import"
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(f"{p}.") for p in prefixes)


def wrong_arrows(files: list[Path], never: tuple[str, ...]) -> list[str]:
    return sorted(
        f"{path.relative_to(ROOT)} -> {name}"
        for path in files
        for name in imports_of(path)
        if under(name, never)
    )


FLOORS = [
    # (what, its files, what it must never name)
    ("records", sorted((ROOT / "lorapool/records").glob("*.py")), (*ABOVE, "redis")),
    ("root modules", sorted((ROOT / "lorapool").glob("*.py")), ABOVE),
    (
        "producer",
        sorted((ROOT / "producer").glob("*.py")),
        ("lorapool.openai", "lorapool.gateway"),
    ),
    (
        "gateway",
        sorted((ROOT / "gateway").glob("*.py")),
        ("torch", "triton", "lorapool.engine", "lorapool.kernels", "lorapool.worker"),
    ),
]
# a root module that only names a room lazily, for the public API (DESIGN.md):
# ``lorapool/__init__.py`` maps LLM, LLMEngine, Producer... to their modules by name
FACES = {ROOT / "lorapool/__init__.py"}


@pytest.mark.parametrize("what, files, never", FLOORS, ids=[f[0] for f in FLOORS])
def test_a_floor_names_nothing_above_it(what, files, never):
    assert len(files) > 3, f"{what}: no files found"  # the walk really read the folder
    assert wrong_arrows([f for f in files if f not in FACES], never) == []


def test_the_gateways_pool_access_holds_no_openai_policy():
    files = [
        ROOT / f"gateway/{name}.py" for name in ("pool", "pool_view", "streams", "redis_watch")
    ]
    assert all(f.is_file() for f in files)
    assert wrong_arrows(files, ("lorapool.openai",)) == []


def test_a_wrong_arrow_is_found(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from lorapool.lifecycle import keys\nimport torch.nn\n")
    names = imports_of(bad)
    assert {"lorapool.lifecycle", "lorapool.lifecycle.keys", "torch.nn"} <= names
    assert under("lorapool.lifecycle.keys", ("lorapool.lifecycle",))
    assert under("torch.nn", ("torch",))
    assert not under("lorapool.lifecycles", ("lorapool.lifecycle",))


PACKAGE_DOCS = [
    "lorapool/records/__init__.py",
    "lorapool/lifecycle/__init__.py",
    "producer/__init__.py",
    "gateway/__init__.py",
]


@pytest.mark.parametrize("path", PACKAGE_DOCS)
def test_each_room_says_which_changes_belong_in_it(path):
    docstring = ast.get_docstring(ast.parse((ROOT / path).read_text())) or ""
    assert "which room a change belongs in" in docstring.lower(), path
