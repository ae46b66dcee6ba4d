"""The worker's helpers reach no one's private members (issue 36, Build 3).

In ``worker/*.py`` an attribute whose name starts with ``_`` is read or written
only on ``self`` or ``cls``: a helper gets the state it works on
(``worker/state.py``) and the collaborators it calls, and uses their public
doors; ``Worker``'s private members stay in ``worker.py``. Dunders and the
named-tuple API (``_replace``, ``_asdict``, ``_fields``, ``_make``) are public.
Checked on the source's syntax tree, so a new ``publisher.worker._drop()`` fails
here before any run.

And what a worker holds changes only through ``WorkerState``'s methods (``hold``,
``release``, ``drop``, ``forget``, ``release_all``): no other module writes into a
``.held`` mapping, so ``state.py`` and its callers are the whole story.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PUBLIC = {"_replace", "_asdict", "_fields", "_make", "_field_defaults"}


def private_reaches(source: str) -> list[tuple[int, str]]:
    """(line, ``owner._name``) of each private attribute used on another than self/cls."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Attribute):
            continue
        name = node.attr
        if not name.startswith("_") or name.startswith("__") or name in PUBLIC:
            continue
        owner = node.value
        if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
            continue
        found.append((node.lineno, f"{ast.unparse(owner)}.{name}"))
    return sorted(found)


MUTATORS = {"pop", "popitem", "clear", "update", "setdefault", "__setitem__", "__delitem__"}


def held_writes(source: str) -> list[tuple[int, str]]:
    """(line, code) of each write into an attribute named ``held`` (``x.held[k] = v``,
    ``del x.held[k]``, ``x.held.pop(k)``, ``x.held = ...``...)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        targets = []
        if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign | ast.Delete):
            targets = node.targets if isinstance(node, ast.Assign | ast.Delete) else [node.target]
        for target in targets:
            inner = target.value if isinstance(target, ast.Subscript) else target
            if isinstance(inner, ast.Attribute) and inner.attr == "held":
                found.append((node.lineno, ast.unparse(node)))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = node.func.value
            named = isinstance(owner, ast.Attribute) and owner.attr == "held"
            if named and node.func.attr in MUTATORS:
                found.append((node.lineno, ast.unparse(node)))
    return sorted(found)


def test_only_the_state_changes_what_a_worker_holds():
    writes = {
        path.name: hits
        for path in sorted((ROOT / "worker").glob("*.py"))
        if path.name != "state.py" and (hits := held_writes(path.read_text()))
    }
    assert writes == {}
    assert held_writes((ROOT / "worker" / "state.py").read_text())  # where they are
    bad = "def f(worker, h):\n    worker.held[h.request_id] = h\n    worker.held.pop(1)\n"
    assert [line for line, _ in held_writes(bad)] == [2, 3]


def test_no_worker_module_reaches_a_private_member_of_another_object():
    reaches = {
        path.name: hits
        for path in sorted((ROOT / "worker").glob("*.py"))
        if (hits := private_reaches(path.read_text()))
    }
    assert reaches == {}


def test_the_check_sees_the_reaches_it_forbids():
    bad = "def f(worker, publisher):\n    worker._drop(1)\n    x = publisher.worker._last\n"
    assert private_reaches(bad) == [(2, "worker._drop"), (3, "publisher.worker._last")]
    fine = "def f(self, item):\n    self._x = item._replace(a=1)\n    return item.__class__\n"
    assert private_reaches(fine) == []
