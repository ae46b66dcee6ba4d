"""A chat job's messages check, ``lorapool.records.messages.check_messages``, against base
builds', in one process (issue 36): each base module's source comes from ``git show
<rev>:lorapool/records/messages.py`` and is loaded beside today's, so all meet the same
interpreter, caches and load. A 4-message chat (system, user, an assistant tool call,
a tool reply); each build's best of ``--number`` calls x ``--rounds``, the builds
alternated ``--alternations`` times:

    python benchmarks/messages_check.py [--base 9b0bc78^ [--base main]] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import timeit
import types
from pathlib import Path

from lorapool.records import messages as head

SYSTEM = "You are a careful assistant that answers in one short paragraph."
USER = "Where is order 42, and when will it arrive? I ordered it on Monday."
CALL = {"name": "find_order", "arguments": '{"order_id": 42}'}
CHAT = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": USER},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": CALL},
        ],
    },  # fmt: skip
    {"role": "tool", "content": '{"status": "shipped"}', "tool_call_id": "call_1"},
]
MAX_BYTES = 1 << 20


def load_base(rev: str) -> types.ModuleType:
    """``lorapool/records/messages.py`` of ``rev``, as a module of its own."""
    root = Path(__file__).resolve().parent.parent
    source = subprocess.run(
        ["git", "show", f"{rev}:lorapool/records/messages.py"],
        cwd=root, check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    module = types.ModuleType(f"base_messages_{rev}")
    sys.modules[module.__name__] = module  # where msgspec resolves its Structs' annotations
    exec(compile(source, f"{rev}:lorapool/records/messages.py", "exec"), module.__dict__)  # noqa: S102
    return module


def per_call(module: types.ModuleType, args: argparse.Namespace) -> float:
    """CPU µs of one check, the best of ``rounds`` rounds of ``number`` calls."""

    def call() -> None:
        module.check_messages(CHAT, MAX_BYTES)

    call()
    times = timeit.repeat(call, timer=time.process_time, repeat=args.rounds, number=args.number)
    return round(min(times) / args.number * 1e6, 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--base", action="append", help="a git revision (9b0bc78^: the hand checks)"
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--number", type=int, default=20000)
    parser.add_argument("--alternations", type=int, default=3)
    args = parser.parse_args()
    builds = {rev: load_base(rev) for rev in args.base or ["9b0bc78^"]}
    builds["head"] = head
    want = head.check_messages(CHAT, MAX_BYTES)
    out = {"outputs_equal": all(b.check_messages(CHAT, MAX_BYTES) == want for b in builds.values())}
    out |= {f"{name}_us": [] for name in builds}
    for _ in range(args.alternations):
        for name, build in builds.items():
            out[f"{name}_us"].append(per_call(build, args))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
