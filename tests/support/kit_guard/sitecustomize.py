"""The GPU machine's package list as an import guard, for the GPU kit's CPU dry run.

Put on PYTHONPATH with ``$LORAPOOL_IMPORT_ALLOW`` naming a file of allowed
top-level module names, it makes every Python process started (the kit, its
sections, the worker it starts) find no top-level module that is neither in
the standard library nor in that file: the modules of the distributions the
GPU machine has, of the .whl/ bundle, and lorapool's own. Each finder on
``sys.meta_path`` is wrapped to answer "not found" for the others, so that a
probe (``importlib.util.find_spec``) sees None and an import raises
ModuleNotFoundError, as where the package is not installed. Each refused name
is appended to ``$LORAPOOL_IMPORT_BLOCKED_LOG``.
"""

import os
import sys


class _Hidden:
    """A meta path finder that finds nothing outside the allowed top-level names."""

    def __init__(self, finder, allowed: set[str], log: str | None):
        self._finder, self._allowed, self._log = finder, allowed, log

    def _refused(self, name: str) -> bool:
        top = name.partition(".")[0]
        if top in self._allowed or top in sys.stdlib_module_names or top.startswith("_sysconfig"):
            return False
        if self._log:
            with open(self._log, "a") as f:
                f.write(f"{top} {os.getpid()}\n")
        return True

    def find_spec(self, name, path=None, target=None):
        if path is None and self._refused(name):
            return None
        find = getattr(self._finder, "find_spec", None)
        return find(name, path, target) if find else None

    def __getattr__(self, attr):  # find_distributions, invalidate_caches, ...
        return getattr(self._finder, attr)


def _install() -> None:
    allow = os.environ.get("LORAPOOL_IMPORT_ALLOW")
    if allow:
        with open(allow) as f:
            allowed = set(f.read().split())
        log = os.environ.get("LORAPOOL_IMPORT_BLOCKED_LOG")
        sys.meta_path[:] = [_Hidden(finder, allowed, log) for finder in sys.meta_path]


_install()
