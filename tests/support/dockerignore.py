"""Docker's .dockerignore rules, as the builder applies them (moby's patternmatcher and
ignorefile), for tests/unit/test_dockerfile.py: Docker is not installed here.

- A line starting with ``#`` is a comment; each line is trimmed; ``!`` makes it an
  exception; a pattern is cleaned like Go's ``filepath.Clean`` and a leading ``/``
  dropped: every pattern is anchored at the context's root (unlike .gitignore, ``*.key``
  matches ``audit.key`` but not ``deploy/audit.key``).
- ``*`` matches any run of characters but ``/``, ``?`` one such character, ``[...]`` a
  class, ``\\`` escapes; ``**`` any number of directories (``**/`` zero or more).
- A path is left out when the last pattern that matches it, or one of its parent
  directories, is not an exception; an exception is only weighed once a pattern matched,
  an exclusion only while none has.
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Pattern:
    text: str
    exclusion: bool  # a "!" line: lets back in what an earlier line left out
    regex: re.Pattern

    def match(self, path: str) -> bool:
        return self.regex.match(path) is not None


def read_patterns(text: str) -> list[Pattern]:
    patterns = []
    for number, raw in enumerate(text.splitlines()):
        line = raw.lstrip("\ufeff") if number == 0 else raw
        if line.startswith("#"):
            continue
        line = line.strip()
        if not line:
            continue
        exclusion = line.startswith("!")
        if exclusion:
            line = line[1:].strip()
        if line:
            line = posixpath.normpath(line)
            if len(line) > 1 and line.startswith("/"):
                line = line[1:]
        patterns.append(Pattern(line, exclusion, re.compile(_regex(line))))
    return patterns


def _regex(pattern: str) -> str:
    out, i = "^", 0
    while i < len(pattern):
        ch = pattern[i]
        i += 1
        if ch == "*" and pattern[i : i + 1] == "*":
            i += 1
            if pattern[i : i + 1] == "/":
                i += 1
            out += ".*" if i == len(pattern) else "(.*/)?"
        elif ch == "*":
            out += "[^/]*"
        elif ch == "?":
            out += "[^/]"
        elif ch == "\\":
            out += re.escape(pattern[i]) if i < len(pattern) else "\\\\"
            i += 1
        elif ch in "[]":
            out += ch
        elif ch == "^" and out.endswith("["):
            out += "^"  # a negated class, as in Go's filepath.Match
        else:
            out += re.escape(ch)
    return out + "$"


def excluded(path: str, patterns: list[Pattern]) -> bool:
    """Whether the builder leaves ``path`` (relative, ``/``-separated) out of the context."""
    parent = posixpath.dirname(path)
    parents = parent.split("/") if parent else []
    matched = False
    for pattern in patterns:
        if pattern.exclusion != matched:
            continue
        hit = pattern.match(path) or any(
            pattern.match("/".join(parents[: i + 1])) for i in range(len(parents))
        )
        if hit:
            matched = not pattern.exclusion
    return matched


def context_files(root: Path, patterns: list[Pattern]) -> list[str]:
    """The files under ``root`` that a build would send: its context."""
    files = (p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
    return sorted(f for f in files if not excluded(f, patterns))
