"""The scheduler driven as ``LLMEngine.step`` drives it, with a simulated model that
emits token 7 and forks ``n`` samples at a request's first token: the fair-share and
fork-slot tests' harness (tests/engine/test_fair_share.py, test_fork_slots.py)."""

import itertools
from typing import NamedTuple

from lorapool.engine.block_manager import BlockManager
from lorapool.engine.scheduler import Scheduler, SchedulerConfig
from lorapool.engine.sequence import Request, Sequence
from lorapool.protocol import SamplingParams

INPUT_COST, OUTPUT_COST = 1.0, 2.0  # SchedulerConfig's defaults
_ids = itertools.count()


def make_request(tenant, prompt_len, max_tokens, n=1, weight=1.0, arrival=None, priority=0):
    request = Request(
        f"r{next(_ids)}",
        None,
        list(range(prompt_len)),
        SamplingParams(max_tokens=max_tokens, n=n),
        arrival_time=arrival if arrival is not None else next(_ids),
        max_tokens=max_tokens,
    )
    request.tenant, request.weight, request.priority = tenant, weight, priority
    seq = Sequence(next(_ids), request, 0, request.prompt_token_ids)
    request.seqs.append(seq)
    return request


def make_scheduler(num_blocks=4096, block_size=4, **config):
    return Scheduler(SchedulerConfig(**config), BlockManager(num_blocks, block_size))


def step(sched):
    """One engine step: the model emits token 7; a request of n samples forks at its
    first token (``LLMEngine._fork``). Returns what was scheduled."""
    out = sched.schedule()
    assert out.num_batched_tokens <= sched.config.max_num_batched_tokens
    assert len(sched.running) <= sched.config.max_num_seqs
    sched.postprocess(out)
    for item in out.scheduled:
        if not item.samples:
            continue
        seq, request = item.seq, item.seq.request
        targets = [seq]
        if request.params.n > 1 and len(request.seqs) == 1:
            for index in range(1, request.params.n):
                child = Sequence(next(_ids), request, index, request.prompt_token_ids)
                request.seqs.append(child)
                sched.fork(seq, child)
                targets.append(child)
        for target in targets:
            target.append_token(7)
            if target.num_output_tokens >= request.max_tokens:
                sched.finish(target)
        assert len(sched.running) <= sched.config.max_num_seqs, "a fork ran past max_num_seqs"
    limit = sched.config.max_num_seqs
    to_fork = sum(min(s.request.params.n, limit) - 1 for s in sched.running if s.request.needs_fork)
    assert sched.slots_held() == len(sched.running) + to_fork <= limit, "slots held for forks"
    return out


def cost(item):
    """An item's weighted service, from its positions: the oracle of the charge."""
    prompt = item.seq.num_prompt_tokens
    total = sum(
        INPUT_COST if p < prompt else OUTPUT_COST
        for p in range(item.start, item.start + item.num_new_tokens)
    )
    return total / item.seq.request.weight


def prefill_positions(item):
    """Positions of a chunk that are not a decode token (one, at an output position)."""
    decode = item.num_new_tokens == 1 and item.start >= item.seq.num_prompt_tokens
    return 0 if decode else item.num_new_tokens


class Step(NamedTuple):
    active: set  # tenants with unfinished work at the step's start
    waiting: set  # tenants with a waiting sequence then
    service: dict  # weighted service per tenant
    prefill: dict  # prefill positions per tenant
    least: set  # the tenants with the least (counter, running sequences) at its start


def simulate(sched, arrivals, max_steps=20_000):
    """arrivals: {step: [requests]}. One ``Step`` a step."""
    pending, added, trace = dict(arrivals), {}, []
    for n in range(max_steps):
        for request in pending.pop(n, []):
            added.setdefault(request.tenant, []).append(request)
            sched.add(request.seqs[0])
        if not sched.has_unfinished() and not pending:
            return trace, added
        active = {s.request.tenant for s in [*sched.waiting, *sched.running]}
        waiting = {s.request.tenant for s in sched.waiting}
        rank = {
            t: (
                sched.ledger.counters.get(t, 0.0),
                sum(s.request.tenant == t for s in sched.running),
            )
            for t in active
        }
        least = {t for t in active if rank[t] == min(rank.values())}
        out = step(sched)
        service, prefill = {}, {}
        for item in out.scheduled:
            tenant = item.seq.request.tenant
            service[tenant] = service.get(tenant, 0.0) + cost(item)
            prefill[tenant] = prefill.get(tenant, 0) + prefill_positions(item)
        trace.append(Step(active, waiting, service, prefill, least))
    raise AssertionError("did not finish")
