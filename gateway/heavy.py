"""Work too heavy for the gateway's event loop, bounded: grammar compilation (in the
sandbox's processes, ``lorapool.grammar_sandbox``) and tokenization or chat-template
rendering of large inputs (in threads; ``tokenizers`` releases the GIL in its batch
calls, so a 1 MiB prompt does not stall the other requests).

Each kind has its own pool of ``workers`` threads: a flood of one kind queues behind
its own pool and never takes the threads of another (nor asyncio's default executor,
which resolves webhooks). Measured on a 2-core CPU VM (benchmarks/RESULTS.md): a
verdict already cached costs a thread hop (~0.1 ms); a fresh one, a round trip to a
warm sandbox process plus the compile itself.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from lorapool.grammar_limits import GrammarLimits
from lorapool.grammar_sandbox import GrammarSandbox


class HeavyWork:
    """The gateway's bounded pools for expensive request work."""

    def __init__(self, limits: GrammarLimits, workers: int):
        self.sandbox = GrammarSandbox(limits, workers)
        self._grammar = ThreadPoolExecutor(workers, thread_name_prefix="lorapool-grammar")
        self._tokens = ThreadPoolExecutor(workers, thread_name_prefix="lorapool-tokens")

    async def compile(self, constraint) -> None:
        """``constraint`` compiled in the sandbox, off the loop: FieldError naming the
        limit or the problem when it does not compile."""
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._grammar, self.sandbox.check, constraint)

    async def tokens(self, work: Callable[..., Any], *args: Any) -> Any:
        """``work(*args)`` (tokenizing, decoding, rendering a template) in the bounded
        pool, off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._tokens, work, *args)

    def close(self) -> None:
        self._grammar.shutdown(wait=False, cancel_futures=True)
        self._tokens.shutdown(wait=False, cancel_futures=True)
        self.sandbox.close()
