"""The prefill cap while tenants contend, after vLLM's ``long_prefill_token_threshold``
applied per tenant. Plain Python, used by ``engine.scheduler`` with the fair share on.

At a step where two or more tenants had work at its start or at one of the W - 1 steps
before (W = ``contended_window_steps``), no tenant's chunks take more than C =
``contended_prefill_tokens`` prompt or recompute positions (a decode token, one at an
output position, is not capped), but those of the tenant with the least counter (ties:
the fewest running sequences), the one the fair share favours: its own prompt runs whole
beside the others' capped chunks. A tenant alone for W steps has the whole budget; in
the window's steps after the others' work ended, it is capped (none is spared then).

Bound: a step that runs the least tenant's work carries at most (k - 1) * C prefill
positions of the other k - 1 tenants with work, beside one decode token per running
sequence, whatever they queue (``tests/engine/test_fair_share.py`` checks it). A
sequence held back by its own tenant's cap waits for that tenant's own chunks, C
positions a step, and is outside the scheduler's fair-share bound as a skipped one is.

Off by default (C None). With the least tenant capped too, a cap of 128 took a light
tenant's p50 from 1.76x to 3.39x of alone with 1,024-token prompts (its own prompt cut
into chunks) and throughput to 0.59 of first come, first served; sparing it gives
1.11x (benchmarks/RESULTS.md, ``bench tenants``). W = 1 by default: a wider window also
caps the step in flight when another tenant's request comes, at a cost in throughput.
"""

from __future__ import annotations

from collections import Counter

from lorapool.engine.fair_share import Ledger
from lorapool.engine.sequence import Sequence


class ContendedCap:
    """One scheduler's cap: ``begin`` each step, then ``room`` before a chunk and
    ``note`` after it, while ``on``."""

    def __init__(self, tokens: int | None, window_steps: int):
        self.tokens = tokens
        self.window_steps = window_steps
        self.on = False  # capping this step
        self.spared: str | None = None  # the tenant it spares this step
        self.prefill: dict[str, int] = {}  # prefill positions this step, by tenant
        self.steps = 0
        self.seen: dict[str, int] = {}  # tenant -> the last step it had work at

    def begin(self, ledger: Ledger, running: list[Sequence]) -> None:
        """A step starts: cap it if two or more tenants had work within the window."""
        self.prefill = {}
        self.on = self.tokens is not None and self._contended(ledger)
        self.spared = self._least(ledger, running) if self.on else None

    def _contended(self, ledger: Ledger) -> bool:
        self.steps += 1
        seen, now = self.seen, self.steps
        for tenant in ledger.active:
            seen[tenant] = now
        if len(seen) > len(ledger.active):  # forget those past the window
            oldest = now - self.window_steps
            self.seen = seen = {t: at for t, at in seen.items() if at > oldest}
        return len(seen) > 1

    @staticmethod
    def _least(ledger: Ledger, running: list[Sequence]) -> str | None:
        """Of two or more tenants with work, the one with the least counter (ties: the
        fewest running sequences); None when one has work (it is capped)."""
        active = ledger.active
        if len(active) < 2:
            return None
        count = Counter(s.request.tenant for s in running)
        counters = ledger.counters
        return min(active, key=lambda t: (counters.get(t, 0.0), count[t]))

    def room(self, seq: Sequence, start: int, num_new: int) -> int:
        """``num_new`` cut to the prefill positions ``seq``'s tenant may still take this
        step; a decode token (one, at an output position) is not cut, nor the spared
        tenant's chunks."""
        tenant = seq.request.tenant
        if (num_new == 1 and start >= seq.request.num_prompt_tokens) or tenant == self.spared:
            return num_new
        return min(num_new, self.tokens - self.prefill.get(tenant, 0))

    def note(self, seq: Sequence, start: int, num_new: int) -> None:
        """``seq``'s chunk ``[start, start + num_new)`` was scheduled."""
        if num_new > 1 or start < seq.request.num_prompt_tokens:
            tenant = seq.request.tenant
            self.prefill[tenant] = self.prefill.get(tenant, 0) + num_new
