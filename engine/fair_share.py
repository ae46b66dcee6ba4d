"""Tenants' fair shares of one engine: a virtual token counter per tenant (VTC).

After Sheng et al., "Fairness in Serving Large Language Models" (OSDI 2024). Plain
Python, used by ``engine.scheduler``.

- **Service.** Every token a step schedules is charged to its sequence's tenant:
  ``input_cost`` for a prompt position, ``output_cost`` for a generated one (a
  recompute after preemption is charged again: it is work done for that tenant),
  divided by the tenant's weight. A request of ``n`` samples is charged for each of
  its sequences' tokens: ``n`` counts as the sequences it is.
- **Counters.** A tenant's counter is the service it received while it had work
  here. A tenant that gets work while it has none (no sequence waiting or running)
  starts at the least counter of the tenants that have some (0 when none has): it
  cannot bank credit while idle, nor carry debt from before. A tenant whose last
  sequence ends is forgotten (memory is bounded by the tenants with work here).
- **Admission.** Waiting sequences are offered in turn to the tenant with the least
  counter (ties: the older head), each tenant's own in ``priority`` order (vLLM's:
  lower first, then arrival): a request's priority orders it among its tenant's
  requests only, never ahead of another tenant's share.
- **Preemption.** When the cache runs out, the victim is the newest running sequence
  of the tenant with the greatest counter (today's choice, the newest, when one
  tenant runs).
- **Refund.** Each scheduled chunk records what it was charged (``ScheduledSeq.charge``)
  so that a speculated token a sequence never uses (async scheduling) is given back
  (``Ledger.refund``).

Requests without a tenant share one default tenant ``""``: alone, the order is the
first-come first-served one of before.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator

DEFAULT_TENANT = ""


class Ledger:
    """Counters of the tenants with work here, and the weighted service they got."""

    def __init__(self, input_cost: float = 1.0, output_cost: float = 2.0):
        self.input_cost = input_cost
        self.output_cost = output_cost
        self.counters: dict[str, float] = {}
        self.active: Counter[str] = Counter()  # sequences waiting or running, by tenant

    def join(self, tenant: str) -> None:
        """One more sequence of ``tenant`` waits or runs here."""
        if not self.active[tenant]:
            others = [self.counters[t] for t in self.active if self.active[t] and t != tenant]
            self.counters[tenant] = min(others, default=0.0)
        self.active[tenant] += 1

    def leave(self, tenant: str) -> None:
        """A sequence of ``tenant`` ended; the tenant is forgotten with its last one."""
        left = self.active[tenant] - 1
        if left > 0:
            self.active[tenant] = left
            return
        self.active.pop(tenant, None)
        self.counters.pop(tenant, None)

    def cost(self, num_prompt_tokens: int, start: int, num_new: int) -> float:
        """Positions ``[start, start + num_new)``: prompt ones at the input cost, the rest
        at the output cost."""
        prompt = min(num_new, max(0, num_prompt_tokens - start))
        return prompt * self.input_cost + (num_new - prompt) * self.output_cost

    def charge(self, tenant: str, weight: float, cost: float) -> float:
        """Add ``cost`` / ``weight`` to ``tenant``'s counter; returns what was added."""
        amount = cost / weight
        self.counters[tenant] = self.counters.get(tenant, 0.0) + amount
        return amount

    def refund(self, tenant: str, amount: float) -> None:
        """Give back a charge (a speculated token its sequence never used)."""
        if tenant in self.counters:
            self.counters[tenant] -= amount

    def order(self, waiting: Iterable, first: list) -> Iterator:
        """The waiting sequences in the order to offer them: ``first`` (the starving
        ones, as they are), then one at a time from the tenant with the least counter
        *at that moment* (a generator: an admission's charge counts for the next
        pick); within a tenant by (priority, position in ``waiting``)."""
        yield from first
        skip = {id(s) for s in first}
        queues: dict[str, list] = {}
        for position, seq in enumerate(waiting):
            if id(seq) not in skip:
                queues.setdefault(seq.request.tenant, []).append(
                    (seq.request.priority, position, seq)
                )
        if len(queues) == 1:  # one tenant: its own order
            [queue] = queues.values()
            queue.sort(key=lambda entry: entry[:2])
            yield from (seq for _, _, seq in queue)
            return
        for queue in queues.values():
            queue.sort(key=lambda entry: entry[:2], reverse=True)  # head at the end
        counters = self.counters
        while queues:
            tenant = min(queues, key=lambda t: (counters.get(t, 0.0), queues[t][-1][1]))
            queue = queues[tenant]
            yield queue.pop()[2]
            if not queue:
                del queues[tenant]


def room_victim(running: list, waiting, ledger: Ledger, skipped: dict, full: bool):
    """The sequence to preempt so that a tenant with nothing running is admitted this
    step (``Scheduler._make_room``), or None: every slot is taken, a tenant with
    nothing running waits (a sequence not skipped for an adapter slot or blocks, which
    have their own bounds) with a counter no greater than that of a tenant running two
    or more sequences; the victim is the sequence of the greatest such tenant with
    the fewest tokens computed (the least work lost; of those, the newest).
    Never a tenant's last, so the preempted tenant keeps running and never preempts
    back (no thrashing)."""
    if not full or len(ledger.active) < 2:
        return None
    counters = ledger.counters
    counts = Counter(s.request.tenant for s in running)
    idle = {t for t in ledger.active if t not in counts}  # all theirs wait
    busy = [t for t, count in counts.items() if count > 1]
    if not idle or not busy:
        return None
    idle = {
        s.request.tenant for s in waiting if s.request.tenant in idle and s.seq_id not in skipped
    }
    if not idle:
        return None
    least = min(counters.get(t, 0.0) for t in idle)
    heaviest = max(busy, key=lambda t: counters.get(t, 0.0))
    if least > counters.get(heaviest, 0.0):
        return None
    # the one that loses the least work: fewest tokens computed (a request still in its
    # prompt, whose held fork slots free with it), the newest of those
    theirs = (s for s in reversed(running) if s.request.tenant == heaviest)
    return min(theirs, key=lambda s: s.num_computed_tokens)


def victim(running: list, i: int, ledger: Ledger) -> object:
    """Which running sequence the cache preempts, of those not yet scheduled this step
    (from ``i``): the newest of the tenant with the greatest counter."""
    counters = ledger.counters
    best = max(
        range(i, len(running)), key=lambda j: (counters.get(running[j].request.tenant, 0.0), j)
    )
    return running[best]


def check_share(priority, tenant, weight) -> tuple[int, str, float]:
    """(priority, tenant, weight) of a request, each checked; ValueError naming the one
    that is wrong."""
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise ValueError(f"priority must be an integer, got {priority!r}")
    if tenant is None:
        tenant = DEFAULT_TENANT
    elif not isinstance(tenant, str):
        raise ValueError(f"tenant must be a string, got {type(tenant).__name__}")
    if weight is None:
        weight = 1.0
    elif isinstance(weight, bool) or not isinstance(weight, int | float):
        raise ValueError(f"tenant_weight must be a number, got {weight!r}")
    elif not 0 < weight < float("inf"):
        raise ValueError(f"tenant_weight must be a finite number > 0, got {weight!r}")
    return priority, tenant, float(weight)
