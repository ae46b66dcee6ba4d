"""An OpenAI request body's parse cost at the gateway's door (issue 36, helper 74): the
body's bytes to a ``Parsed`` (prompts, SamplingParams, metadata), as the routes do it.

On a build with ``lorapool.openai.bodies`` the parsers read the bytes through their
msgspec Struct; on a build before, the route read them with orjson and the parsers
checked the dict by hand; the script times whichever it imports, so a base and a head
come from the same script (run each with its own tree first on PYTHONPATH):

    python benchmarks/request_parse.py [--rounds 7] [--number 20000]
"""

from __future__ import annotations

import argparse
import json
import time
import timeit
from functools import partial

import orjson

from lorapool.openai import params
from lorapool.openai.params import parse_chat, parse_completion, parse_job

try:
    import lorapool.openai.bodies  # noqa: F401 - the head: the parsers read the bytes

    def read(raw: bytes):
        return raw

    BUILD = "head"
except ImportError:  # the base: the route's orjson.loads, then the hand checks
    read, BUILD = orjson.loads, "base"

PROMPT = "Translate the following question into SQL over the table orders: " * 3
SYSTEM = "You are a careful assistant that answers in one short paragraph."
ORDER = {"type": "object", "properties": {"order_id": {"type": "integer"}}}
TOOLS = [{"type": "function", "function": {"name": "find_order", "parameters": ORDER}}]
BODIES = {
    "completion": {
        "model": "sql-lora",
        "prompt": PROMPT,
        "max_tokens": 128,
        "temperature": 0.7,
        "top_p": 0.95,
        "stop": ["\n\n"],
        "stream": True,
        "stream_options": {"include_usage": True},
    },
    "chat": {
        "model": "sql-lora",
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": PROMPT},
            {"role": "assistant", "content": "SELECT count(*) FROM orders;", "refusal": None},
            {"role": "user", "content": [{"type": "text", "text": "And per customer?"}]},
        ],
        "max_completion_tokens": 256,
        "temperature": 0.2,
        "logprobs": True,
        "top_logprobs": 2,
        "user": "tenant-7",
    },
    "chat_tools": {
        "model": "sql-lora",
        "messages": [{"role": "user", "content": "Where is order 42?"}],
        "tools": TOOLS,
        "tool_choice": "auto",
        "max_tokens": 64,
    },
    "job": {"model": "sql-lora", "prompt": PROMPT, "max_tokens": 64, "request_id": "order-42"},
}
ROUTES = {
    "completion": lambda raw: parse_completion(read(raw), 16),
    "chat": lambda raw: parse_chat(read(raw)),
    "chat_tools": lambda raw: parse_chat(read(raw)),
    "job": lambda raw: parse_job(read(raw)),
}


# the batch service's line: a dict already
DICT_ROUTES = {"completion": lambda value: parse_completion(value, 16), "chat": parse_chat}


def _per_call(call, args) -> float:
    """CPU µs of one ``call``, the best of ``rounds`` rounds of ``number`` calls (CPU
    time: the box is shared, and a wall clock would count the other processes' turns)."""
    call()  # parses (and warms)
    times = timeit.repeat(call, timer=time.process_time, repeat=args.rounds, number=args.number)
    return round(min(times) / args.number * 1e6, 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--number", type=int, default=20000)
    args = parser.parse_args()
    out = {"build": BUILD, "params": params.__file__}
    for name, body in BODIES.items():
        raw = orjson.dumps(body)
        out[name] = _per_call(partial(ROUTES[name], raw), args)
        if name in DICT_ROUTES:
            out[f"{name}_dict"] = _per_call(partial(DICT_ROUTES[name], orjson.loads(raw)), args)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
