"""Continuous batching with chunked prefill, plain Python.

Every step spends a budget of ``max_num_batched_tokens``: first on the running
sequences in arrival order (one token each when decoding, the next chunk of
their prompt when prefilling), then on waiting sequences in arrival order.
When the KV cache runs out of blocks the newest running sequence is preempted:
its blocks are freed and it returns to the head of the queue, to be
recomputed from its tokens later. Nothing is ever dropped; a sequence that
could never fit was refused at ``add_request``. With prefix caching, a
sequence admitted from the queue (new, or preempted) first takes its cached
prefix (``BlockManager.acquire_prefix``) and only the rest costs budget; the
blocks a step fills are named for reuse in ``postprocess``.

Adapters: a step runs at most ``max_loras`` distinct adapters (the base model,
id 0, does not count). A waiting sequence whose adapter has no slot is
skipped, so it does not block the others. It is not starved: once it has been
skipped for S = ``starvation_steps`` steps, no adapter sequence behind it is
admitted (base-model ones still are), so the running adapters drain and the
first slot that frees is its own. Bound: with k distinct adapters waiting
ahead of it, a sequence is admitted within (k + 1) * (S + D) steps, where D is
the most steps a running sequence needs to finish (its remaining tokens, as
every running sequence advances every step: max_num_batched_tokens >=
max_num_seqs).

Blocks: a waiting sequence that cannot get the blocks of its next chunk is
skipped the same way, so the later ones that fit run meanwhile (no head-of-line
blocking: a request of many samples waiting for room does not hold up small
ones). Once it has been skipped S times, nothing behind it is admitted, so the
running sequences drain and free their blocks: it is admitted within S + D
steps of reaching the head of the queue (it fits in an empty cache: a request
that cannot was refused at ``add_request``). With the fair share on, for the S
steps after it starts starving, a tenant running nothing, with a counter no greater
than the starving one's tenant's, still gets a sequence past it (``_make_room``
would preempt for it anyway); then nothing passes: within 2S + 2D steps.

Tenants (``engine.fair_share``): waiting sequences are offered slots in turn to
the tenant with the least virtual token counter (the weighted service it got since
it last had work here), the starving ones above first; the cache's victim is the
heaviest tenant's newest running sequence. Requests without a tenant share one:
alone, the order is first come, first served as before. Bound: take tenants f and
g, and a step s at which g gets work while f has some (so g starts at a counter
no greater than f's), and suppose no sequence of g is skipped for an adapter slot,
blocks or its samples' slots (those keep the bounds above). Then through every step t until g has no
sequence waiting, f's weighted service over [s, t] exceeds g's by at most
(max_num_seqs + 1) * L_f, L_f the most one of f's requests costs, weighted: its
prompt, n samples' tokens, and the prompt again for each sample past max_num_seqs
(``tests/engine/test_fair_share.py`` checks it against service
recomputed from each step's chunks). Why: f is admitted ahead of g only with a
counter no greater than g's; after f's last such admission f is charged only for
sequences of requests then running (at most max_num_seqs) and their forks, and
one more admitted in the step that takes g's last waiting sequence. And a
tenant with nothing running does not wait for a slot to free: when every slot is
taken and its counter is at most that of a tenant running two or more sequences,
that tenant's sequence with the least work done is preempted for it (``_make_room``: one a step,
never a tenant's last, so no two tenants preempt each other back and forth). A
light tenant's request therefore starts at the next step whatever a flooding
tenant has queued or running, given the blocks it needs.

Samples: a request of n > 1 forks at its first token; it is admitted only with slots for
min(n, max_num_seqs) samples (held until it forks: ``slots_held``), else skipped as for
blocks, so no fork waits to recompute the prompt; forks respect max_num_seqs (``fork``).

Prefill under contention: ``engine.contention`` (off by default). Async scheduling
(``engine.async_scheduling``, off by default): ``engine.scheduler_output`` says how it fits.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from lorapool.engine.block_manager import BlockManager
from lorapool.engine.contention import ContendedCap
from lorapool.engine.fair_share import Ledger, room_victim, victim
from lorapool.engine.scheduler_output import ScheduledSeq, SchedulerOutput
from lorapool.engine.sequence import Sequence, SequenceStatus


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_loras: int | None = None  # None: adapters unlimited (LoRA disabled)
    starvation_steps: int = 8
    fair_share: bool = True  # False: first come, first served whatever the tenant
    input_cost: float = 1.0  # a prompt token's charge to its tenant (engine.fair_share)
    output_cost: float = 2.0  # a generated token's
    contended_prefill_tokens: int | None = None  # engine.contention's C; None: no cap
    contended_window_steps: int = 1  # steps a tenant counts as contending (1: while it has work)

    def __post_init__(self):
        names = ("max_num_seqs", "max_num_batched_tokens", "starvation_steps")
        for name in (*names, "contended_window_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("input_cost", "output_cost"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and 0 <= value < float("inf")):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        cap = self.contended_prefill_tokens
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
            raise ValueError(
                f"contended_prefill_tokens must be an integer >= 1 or None, got {cap!r}"
            )
        if self.max_loras is not None and self.max_loras < 1:
            raise ValueError(f"max_loras must be at least 1, got {self.max_loras}")


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager):
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # seq_id -> steps skipped for want of an adapter slot or of free blocks
        self.num_skipped: dict[int, int] = {}
        self.num_preemptions = 0
        self._unforked = 0  # slots held for running requests' samples yet to fork
        self._held: dict[int, int] = {}  # the running sequence's seq_id -> those slots
        self.ledger = Ledger(config.input_cost, config.output_cost)
        self.cap = ContendedCap(config.contended_prefill_tokens, config.contended_window_steps)

    def add(self, seq: Sequence) -> None:
        self.ledger.join(seq.request.tenant)
        self.waiting.append(seq)

    def slots_held(self) -> int:
        """Sequence slots taken: the running ones, and the n - 1 samples each running
        request of n not yet forked will fork into at its first token."""
        return len(self.running) + self._unforked

    def _forks_to_come(self, seq: Sequence) -> int:
        n = seq.request.params.n
        return min(n, self.config.max_num_seqs) - 1 if seq.request.needs_fork else 0

    def _release(self, seq: Sequence) -> None:
        """``seq`` left the running ones, or forked: the slots held for its forks free."""
        self._unforked -= self._held.pop(seq.seq_id, 0)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def starving(self) -> bool:
        """Some waiting sequence was skipped ``starvation_steps`` times: newcomers wait."""
        limit = self.config.starvation_steps
        return any(n >= limit for n in self.num_skipped.values())

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        if self.config.fair_share:
            self.cap.begin(self.ledger, self.running)
        if self.config.fair_share and self.waiting:
            self._make_room(out)
        made_room = len(out.preempted)
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        if len(out.preempted) == made_room:  # no preemption for want of blocks
            self._schedule_waiting(out, budget)
        return out

    def _make_room(self, out: SchedulerOutput) -> None:
        """A tenant with nothing running waits while every slot is taken: preempt one
        sequence for it (``fair_share.room_victim`` says which, and when)."""
        config = self.config
        full = self.slots_held() >= config.max_num_seqs
        seq = room_victim(self.running, self.waiting, self.ledger, self.num_skipped, full)
        if seq is not None:
            self._preempt(seq, out)

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        charges: dict[str, float] = {}  # decode tokens' charges by tenant
        decode_cost = self.config.output_cost if self.config.fair_share else 0.0
        budget = self._running_pass(out, budget, charges, decode_cost)
        for tenant, amount in charges.items():
            self.ledger.charge(tenant, 1.0, amount)
        return budget

    def _running_pass(self, out, budget: int, charges: dict, decode_cost: float) -> int:
        """The running sequences' chunks; a decode token's charge goes to ``charges``."""
        i, manager, scheduled = 0, self.block_manager, out.scheduled
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_uncomputed_tokens, budget)
            if self.cap.on:
                num_new = self.cap.room(seq, seq.num_computed_tokens, num_new)
                if num_new <= 0:  # its tenant's prefill cap is spent: next step
                    i += 1
                    continue
            if manager.fits_in_place(seq, num_new):  # the common decode step: no blocks
                start, request = seq.num_computed_tokens, seq.request
                if num_new == 1 and start >= request.num_prompt_tokens and decode_cost:
                    amount = decode_cost / request.weight  # charged below, in one go
                    charges[request.tenant] = charges.get(request.tenant, 0.0) + amount
                    scheduled.append(ScheduledSeq(seq, start, 1, amount))
                else:
                    scheduled.append(self._charged(seq, num_new))
                budget -= num_new
                i += 1
                continue
            while not self.block_manager.can_allocate(seq, num_new):
                victim = self._victim(i)
                self._preempt(victim, out)
                if victim is seq:
                    break
            if seq.status != SequenceStatus.RUNNING:
                break
            self._admit_tokens(seq, num_new, out)
            budget -= num_new
            i += 1
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        limit = self.config.max_num_seqs
        if not self.waiting or self.slots_held() >= limit or not budget:
            return  # most decode steps: no need to look at the running adapters
        active = {s.lora_int_id for s in self.running} - {0}
        blocked_new_adapters = False
        starving = None  # (its counter, the tenants running) once one starves this step
        for seq in self._offer_order():
            if budget == 0 or self.slots_held() >= limit:
                break
            if starving is not None and not self._passes(seq, *starving):
                continue
            if not self._adapter_fits(seq, active, blocked_new_adapters):
                blocked_new_adapters |= self._note_skipped(seq)
                continue
            forks = self._forks_to_come(seq)
            if self.slots_held() + 1 + forks > limit:  # no slots for its samples yet
                if self._note_skipped(seq):  # as for blocks, below
                    starving = starving or self._starving(seq)
                    if not starving:
                        break
                continue
            room = budget
            if self.cap.on:
                room = self.cap.room(seq, 0, budget)
                if room <= 0:  # its tenant's prefill cap is spent: its own work, next step
                    continue
            num_new = self._start(seq, room)
            if num_new is None:  # no blocks for it yet: later ones that fit may go first
                if self._note_skipped(seq):  # until it starves: then only newcomers pass
                    starving = starving or self._starving(seq)
                    if not starving:
                        break
                continue
            self.waiting.remove(seq)
            self.num_skipped.pop(seq.seq_id, None)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            if forks:
                self._held[seq.seq_id] = forks
                self._unforked += forks
            self._admit_tokens(seq, num_new, out)
            if starving:
                starving[1].add(seq.request.tenant)
            active.add(seq.lora_int_id)
            active.discard(0)
            budget -= num_new

    def _starving(self, seq: Sequence) -> tuple[float, set[str]] | None:
        """``seq`` starves: nothing behind it is admitted but a newcomer's sequence (its
        tenant runs nothing, its counter is no greater than ``seq``'s tenant's: the one
        ``_make_room`` would preempt for), for S steps. None when none may pass (stop)."""
        busy = {s.request.tenant for s in self.running} | {seq.request.tenant}
        if not self.config.fair_share or not set(self.ledger.active) - busy:
            return None
        if self.num_skipped[seq.seq_id] >= 2 * self.config.starvation_steps:
            return None  # for S steps only: then nothing passes (the bound above)
        return self.ledger.counters.get(seq.request.tenant, 0.0), busy

    def _passes(self, seq: Sequence, counter: float, busy: set[str]) -> bool:
        tenant = seq.request.tenant
        return tenant not in busy and self.ledger.counters.get(tenant, 0.0) <= counter

    def _offer_order(self):
        """The waiting sequences in the order admission offers them slots: first come,
        first served without fair share; with it, the starving ones first (their bounds
        above hold as they were), then by tenants' counters (``fair_share.Ledger.order``)."""
        if not self.config.fair_share:
            return list(self.waiting)
        limit = self.config.starvation_steps
        skipped = self.num_skipped
        first = [s for s in self.waiting if skipped.get(s.seq_id, 0) >= limit] if skipped else []
        return self.ledger.order(list(self.waiting), first)

    def _victim(self, i: int) -> Sequence:
        """Which running sequence to preempt, of those not yet scheduled this step (from
        ``i``): the newest, or with the fair share on, ``fair_share.victim``'s."""
        if not self.config.fair_share or len(self.ledger.active) < 2:
            return self.running[-1]
        return victim(self.running, i, self.ledger)

    def _charged(self, seq: Sequence, num_new: int) -> ScheduledSeq:
        """The step's chunk of ``seq``, charged to its tenant (with the fair share on)."""
        start, request = seq.num_computed_tokens, seq.request
        if self.cap.on:
            self.cap.note(seq, start, num_new)
        if not self.config.fair_share:
            return ScheduledSeq(seq, start, num_new)
        cost = self.ledger.cost(request.num_prompt_tokens, start, num_new)
        return ScheduledSeq(
            seq, start, num_new, self.ledger.charge(request.tenant, request.weight, cost)
        )

    def refund(self, item: ScheduledSeq) -> None:
        """Give back what ``item`` was charged: a token its sequence never used (a stop
        string known a step late: ``engine.async_output``)."""
        self.ledger.refund(item.seq.request.tenant, item.charge)
        item.charge = 0.0

    def _start(self, seq: Sequence, budget: int) -> int | None:
        """Its cached prefix and its first chunk's size; None, holding nothing, if no room."""
        manager = self.block_manager
        # prompt logprobs need every prompt position computed: no cache for those
        wants_all = seq.request.params.prompt_logprobs is not None
        cached = 0 if wants_all else manager.acquire_prefix(seq) or manager.share_prompt(seq)
        num_new = min(seq.num_uncomputed_tokens, budget)
        if not manager.can_allocate(seq, num_new):
            manager.free(seq)
            seq.num_computed_tokens = 0
            return None
        manager.count_query(seq.num_tokens, cached)
        return num_new

    def _adapter_fits(self, seq: Sequence, active: set[int], blocked: bool) -> bool:
        lora_id = seq.lora_int_id
        if lora_id == 0:
            return True
        if blocked:  # an older sequence is starving: let the running adapters drain
            return False
        limit = self.config.max_loras
        return lora_id in active or limit is None or len(active) < limit

    def _note_skipped(self, seq: Sequence) -> bool:
        """Count a skip; True once the sequence is starving (blocks new adapters)."""
        skipped = self.num_skipped.get(seq.seq_id, 0) + 1
        self.num_skipped[seq.seq_id] = skipped
        return skipped >= self.config.starvation_steps

    def _admit_tokens(self, seq: Sequence, num_new: int, out: SchedulerOutput) -> None:
        out.blocks_to_copy += self.block_manager.allocate(seq, num_new)
        out.scheduled.append(self._charged(seq, num_new))

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self._release(seq)
        self.block_manager.free(seq)
        seq.reset_for_recompute()
        self.num_preemptions += 1
        out.preempted.append(seq)
        self._requeue(seq)

    def _requeue(self, seq: Sequence) -> None:
        """Back into the queue, ahead of everything that arrived later."""
        position = 0
        while position < len(self.waiting) and self._older(self.waiting[position], seq):
            position += 1
        self.waiting.insert(position, seq)

    @staticmethod
    def _older(a: Sequence, b: Sequence) -> bool:
        return (a.request.arrival_time, a.seq_id) < (b.request.arrival_time, b.seq_id)

    def postprocess(self, out: SchedulerOutput) -> None:
        """The step ran: the scheduled tokens are now in the cache."""
        caching = self.block_manager.enable_prefix_caching
        for item in out.scheduled:
            end = item.start + item.num_new_tokens
            item.seq.num_computed_tokens = end
            if caching:
                self.block_manager.cache_blocks(item.seq, item.start, end)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """``child`` starts running beside ``parent``, sharing its blocks, while fewer
        than ``max_num_seqs`` run; else it waits, holding no blocks, and is admitted as
        a preempted sequence is (recomputed from its tokens; with prefix caching its
        prompt's full blocks are found again)."""
        self.ledger.join(child.request.tenant)
        self._release(parent)  # its first fork: the slots are no longer held, but taken
        if self.slots_held() >= self.config.max_num_seqs:
            child.num_computed_tokens = 0
            child.status = SequenceStatus.WAITING
            self._requeue(child)
            return
        self.block_manager.fork(parent, child)
        child.num_computed_tokens = parent.num_computed_tokens
        child.status = SequenceStatus.RUNNING
        self.running.insert(self.running.index(parent) + 1, child)

    def finish(self, seq: Sequence) -> None:
        """Remove ``seq`` (finished or aborted) and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
            self._release(seq)
            self.ledger.leave(seq.request.tenant)
        elif seq in self.waiting:
            self.waiting.remove(seq)
            self.ledger.leave(seq.request.tenant)
        self.num_skipped.pop(seq.seq_id, None)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
