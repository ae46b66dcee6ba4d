"""The hostile tenant of ``hostile_tenants`` (and ``refusal_cost``): issue 51's rows 1-5
as request bodies encoded once, the loops that send them, and the process they run in
(another client than the light tenant's, as in life)."""

from __future__ import annotations

import asyncio
import os
import time
from collections import Counter

ATTACKS = ("ref_chain", "lark_chain", "gbnf", "tokenize", "n64", "streams")


def _ref_chain(depth: int = 3000) -> dict:
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(depth)}
    defs[f"d{depth}"] = {"type": "string"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def _lark_chain(rules: int = 3000) -> str:
    lines = [f"r{i}: r{i + 1}" for i in range(rules)]
    return "start: r0\n" + "\n".join(lines) + f'\nr{rules}: "x"\n'


def _gbnf(rules: int = 1000) -> str:
    lines = [f'r{i} ::= "a" r{i + 1} | "b"' for i in range(rules)]
    return "root ::= r0\n" + "\n".join(lines) + f'\nr{rules} ::= "z"\n'


class Hostile:
    """The hostile tenant's loops; ``answers`` counts each attack's replies by status."""

    def __init__(self, url: str, headers: dict, model: str, streams: int):
        self.url, self.headers, self.model, self.streams = url, headers, model, streams
        self.answers: Counter = Counter()
        self.encoded = self.bodies()

    async def _post(self, http, kind: str, path: str, body: bytes, timeout=120.0) -> None:
        headers = {**self.headers, "Content-Type": "application/json"}
        try:
            reply = await http.post(self.url + path, content=body, headers=headers, timeout=timeout)
            self.answers[f"{kind} {reply.status_code}"] += 1
        except Exception as error:  # noqa: BLE001 - counted: a dead gateway is the finding
            self.answers[f"{kind} {type(error).__name__}"] += 1
            await asyncio.sleep(0.5)

    def _chat(self, **extra) -> dict:
        messages = [{"role": "user", "content": "Write a word."}]
        return {"model": self.model, "messages": messages, "max_tokens": 1, **extra}

    async def run(self, kind: str, http, end: float) -> None:
        if kind == "streams":
            return await self._hold_streams(http, end)
        width = {"tokenize": 4, "n64": 2}.get(kind, 1)
        await asyncio.gather(*(self._loop(kind, http, end) for _ in range(width)))

    def bodies(self) -> dict[str, tuple[str, bytes]]:
        """Each attack's (path, body), encoded once: the attacking client's own CPU (6 MB
        of JSON four at a time, a 3,000-rule grammar a call) is not what is measured, and
        on a small box it shares the cores with the pool under test."""
        import orjson

        schema = {"name": "deep", "schema": _ref_chain()}
        n64 = {"model": self.model, "prompt": "Once upon a time", "n": 64}
        n64 |= {"max_tokens": 30, "ignore_eos": True}
        big = {"model": self.model, "prompt": "word " * (6 * 1024 * 1024 // 5)}
        deep = {"type": "json_schema", "json_schema": schema}
        chat = "/v1/chat/completions"
        made = {
            "ref_chain": (chat, self._chat(response_format=deep)),
            "lark_chain": (chat, self._chat(guided_grammar=_lark_chain())),
            "gbnf": (chat, self._chat(guided_grammar=_gbnf())),
            "tokenize": ("/tokenize", big),
            "n64": ("/v1/completions", n64),
        }
        return {kind: (path, orjson.dumps(body)) for kind, (path, body) in made.items()}

    async def _loop(self, kind: str, http, end: float) -> None:
        path, body = self.encoded[kind]
        timeout = 600.0 if kind == "n64" else 120.0
        while time.monotonic() < end:
            await self._post(http, kind, path, body, timeout)

    async def _hold_streams(self, http, end: float) -> None:
        job = {"model": self.model, "prompt": "held", "max_tokens": 1}
        reply = await http.post(self.url + "/v1/jobs", json=job, headers=self.headers, timeout=30)
        if reply.status_code != 202:
            self.answers[f"streams submit {reply.status_code}"] += 1
            return
        events = f"{self.url}/v1/jobs/{reply.json()['id']}/events"

        async def hold():
            try:
                async with http.stream("GET", events, headers=self.headers, timeout=None) as s:
                    self.answers[f"streams {s.status_code}"] += 1
                    async for _ in s.aiter_raw():
                        if time.monotonic() > end:
                            return
            except Exception as error:  # noqa: BLE001
                self.answers[f"streams {type(error).__name__}"] += 1

        tasks = [asyncio.create_task(hold()) for _ in range(self.streams)]
        await asyncio.sleep(max(0.0, end - time.monotonic()))
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def attack(url: str, headers: dict, model: str, streams: int, attacks, end: float):
    import httpx

    hostile = Hostile(url, headers, model, streams)
    limits = httpx.Limits(max_connections=streams + 64, max_keepalive_connections=64)
    async with httpx.AsyncClient(limits=limits) as http:
        attacking = [asyncio.create_task(hostile.run(kind, http, end)) for kind in attacks]
        # each loop ends at ``end``; one call may still be on its way
        _, pending = await asyncio.wait(attacking, timeout=max(0.0, end - time.monotonic()) + 60)
        for task in pending:
            task.cancel()
    return dict(hostile.answers)


def attacker(pipe, url: str, headers: dict, model: str, streams: int, attacks, nice: int):
    """The hostile tenant's process: another client than the light tenant, as it is in
    life (sharing one event loop, the light calls' times included the attack's sends).
    Encodes its bodies, says it is ready, runs the attacks until the end it is sent
    (CLOCK_MONOTONIC is the machine's), and sends back its answers. ``nice``: lowered in
    the OS's scheduler, to stand for a client on another machine on a box too small to
    have one."""
    if nice:
        os.nice(nice)
    Hostile(url, headers, model, streams)  # the bodies' first encoding, before the clock
    pipe.send("ready")
    end = pipe.recv()
    pipe.send(asyncio.run(attack(url, headers, model, streams, attacks, end)))
