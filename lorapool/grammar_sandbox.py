"""Grammar compilation where a native crash or a runaway cannot take the caller down.

``GrammarSandbox.check(params)`` first counts ``params`` against the ``GrammarLimits``
(pure Python), then has one of a few child processes (``python -m
lorapool.grammar_sandbox``, each under an address-space limit) compile it with
llguidance. A child that dies (a SIGSEGV in the native library), passes
``compile_timeout_s`` (it is killed) or runs out of memory costs its own process: the
caller gets a ``FieldError`` naming what happened and a fresh child takes its place.
Verdicts are cached by the constraint's hash, so a repeated grammar costs once.

The protocol is one line of JSON each way: ``{"params": {...}}`` in, ``{"ok": true,
"grammar": "..."}`` or ``{"ok": false, "error": "..."}`` out; the grammar comes back so
that the worker compiles it with its tokenizer without converting it again (a GBNF's
conversion to Lark is Python, ~0.4 s at the rule limit).
"""

from __future__ import annotations

import hashlib
import os
import select
import subprocess
import sys
import threading
import time
from collections import OrderedDict

import orjson

from lorapool.grammar_limits import DEFAULT_LIMITS, GrammarLimits, check_structure
from lorapool.records.errors import FieldError

MAX_VERDICTS = 1024  # cached verdicts (a digest and a message each)
# a child's start (an interpreter, llguidance imported): not counted in a compile's time;
# ~0.3 s on a 2-core CPU VM, several seconds when it is loaded
STARTUP_S = 60.0


class GrammarSandbox:
    """A bounded pool of compile processes, thread-safe; ``size`` compiles at a time."""

    def __init__(self, limits: GrammarLimits = DEFAULT_LIMITS, size: int = 2):
        self.limits = limits
        self.size = size
        self._idle: list[_Child] = []
        self._slots = threading.BoundedSemaphore(size)
        self._lock = threading.Lock()
        self._verdicts: OrderedDict[str, str | None] = OrderedDict()
        self.stats = {"compiles": 0, "cached": 0, "crashes": 0, "timeouts": 0}

    def check(self, params, grammar: bool = False) -> str | None:
        """The grammar of ``params`` (llguidance's text, as ``grammar_of`` makes it) when
        it was compiled now, None when its verdict was cached (``grammar``: compiled
        again for its text rather than None, so that the caller need not convert it
        in its own process); FieldError naming the problem when ``params`` (a
        StructuredOutputsParams) passes a limit, does not compile, crashes the compiler
        or runs too long."""
        check_structure(params, self.limits)
        key = digest(params)
        with self._lock:
            if key in self._verdicts and not (grammar and self._verdicts[key] is None):
                self.stats["cached"] += 1
                self._verdicts.move_to_end(key)
                error = self._verdicts[key]
                if error is not None:
                    raise FieldError(error)
                return None
        error, grammar = self._compile(params)
        with self._lock:
            self._verdicts[key] = error
            if len(self._verdicts) > MAX_VERDICTS:
                self._verdicts.popitem(last=False)
        if error is not None:
            raise FieldError(error)
        return grammar

    def _compile(self, params) -> tuple[str | None, str | None]:
        """(error, grammar): one of them."""
        with self._slots:
            child = self._take()
            self.stats["compiles"] += 1
            try:
                error, grammar, healthy = child.compile(params, self.limits)
            except BaseException:
                child.kill()
                raise
            if healthy:
                with self._lock:
                    self._idle.append(child)
            elif "crashed" in (error or ""):
                self.stats["crashes"] += 1
            else:
                self.stats["timeouts"] += 1
            return error, grammar

    def _take(self) -> _Child:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        return _Child(self.limits.compile_memory_mb)

    def warm(self) -> None:
        """Start one child now (its interpreter and llguidance load in the background)."""
        with self._lock:
            if not self._idle:
                self._idle.append(_Child(self.limits.compile_memory_mb))

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for child in idle:
            child.kill()


def digest(params) -> str:
    """The hash a constraint's verdict and compiled grammar are cached under."""
    parts = (params.kind, params.spec, params.disable_any_whitespace,
             params.whitespace_pattern, params.disable_additional_properties)  # fmt: skip
    return hashlib.sha256(orjson.dumps(parts)).hexdigest()


class _Child:
    """One compile process."""

    def __init__(self, memory_mb: int):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "lorapool.grammar_sandbox", str(memory_mb)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        self.ready = False

    def compile(self, params, limits: GrammarLimits) -> tuple[str | None, str | None, bool]:
        """(the error or None, the grammar or None, whether the child can take another)."""
        kind = f"{WHERE}.{params.kind}"
        if not self.ready:  # its "ready" line: imports done
            self.ready = bool(self._read_line(STARTUP_S))
            if not self.ready:
                self.kill()
                return f"{kind}: the grammar compiler did not start", None, False
        try:
            self.proc.stdin.write(orjson.dumps({"params": params.to_dict()}) + b"\n")
            self.proc.stdin.flush()
        except OSError:
            return self._crashed(kind), None, False
        line = self._read_line(limits.compile_timeout_s)
        if line is None:
            self.kill()
            return (f"{kind}: compiling it took over compile_timeout_s="
                    f"{limits.compile_timeout_s:g}s; simplify it"), None, False  # fmt: skip
        if not line:
            return self._crashed(kind), None, False
        reply = orjson.loads(line)
        return reply.get("error"), reply.get("grammar"), True

    def _crashed(self, kind: str) -> str:
        code = self.proc.wait()
        return (f"{kind}: the grammar compiler crashed on it (exit {code}: too deep or too "
                "large; compile_memory_mb and the structure limits bound it)")  # fmt: skip

    def _read_line(self, timeout: float) -> bytes | None:
        """A reply line, b"" when the child died, None past ``timeout``."""
        out = self.proc.stdout
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([out], [], [], left)
            if ready:
                return out.readline()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            pipe.close()


WHERE = "structured_outputs"


def _serve(memory_mb: int) -> None:
    """The child: compile each constraint read from stdin, answer on stdout."""
    import resource

    limit = memory_mb << 20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    import llguidance  # noqa: F401 - loaded before "ready": a compile's time is its own

    from lorapool.records.structured import StructuredOutputsParams, check_grammar

    sys.stdout.buffer.write(b"ready\n")
    sys.stdout.buffer.flush()
    for line in sys.stdin.buffer:
        try:
            params = StructuredOutputsParams.from_dict(orjson.loads(line)["params"])
            reply = {"ok": True, "grammar": check_grammar(params)}
        except FieldError as exc:
            reply = {"ok": False, "error": str(exc)}
        except MemoryError:
            reply = {"ok": False, "error": f"{WHERE}: compiling it passed compile_memory_mb"}
        except Exception as exc:  # noqa: BLE001 - the compiler's own words name the problem
            reply = {"ok": False, "error": f"{WHERE}: {exc}"}
        sys.stdout.buffer.write(orjson.dumps(reply) + b"\n")
        sys.stdout.buffer.flush()


if __name__ == "__main__":
    os.environ.setdefault("RAYON_NUM_THREADS", "1")
    _serve(int(sys.argv[1]))
