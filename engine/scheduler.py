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
that cannot was refused at ``add_request``).

Tenants (``engine.fair_share``): waiting sequences are offered slots in turn to
the tenant with the least virtual token counter (the weighted service it got since
it last had work here), the starving ones above first; the cache's victim is the
heaviest tenant's newest running sequence. Requests without a tenant share one:
alone, the order is first come, first served as before. Bound: take tenants f and
g, and a step s at which g gets work while f has some (so g starts at a counter
no greater than f's), and suppose no sequence of g is skipped for an adapter slot
or blocks (those keep the bounds above). Then through every step t until g has no
sequence waiting, f's weighted service over [s, t] exceeds g's by at most
(max_num_seqs + 1) * L_f, L_f the most one of f's requests costs, weighted: its
prompt, n samples' tokens, and the prompt again for each sample that forked while
no slot was free (``tests/engine/test_fair_share.py`` checks it against service
recomputed from each step's chunks). Why: f is admitted ahead of g only with a
counter no greater than g's; after f's last such admission f is charged only for
sequences of requests then running (at most max_num_seqs) and their forks, and
one more admitted in the step that takes g's last waiting sequence. And a
tenant with nothing running does not wait for a slot to free: when every slot is
taken and its counter is at most that of a tenant running two or more sequences,
that tenant's newest sequence is preempted for it (``_make_room``: one a step,
never a tenant's last, so no two tenants preempt each other back and forth). A
light tenant's request therefore starts at the next step whatever a flooding
tenant has queued or running, given the blocks it needs. Forked samples respect
``max_num_seqs`` (``fork``).

Prefill under contention (after vLLM's ``long_prefill_token_threshold``, applied per
tenant): at a step where two or more tenants had work at its start or at one of the
W - 1 steps before (W = ``contended_window_steps``), no tenant's chunks take more than
C = ``contended_prefill_tokens`` prompt or recompute positions (a decode token, one at
an output position, is not capped); a tenant alone for W steps has the whole budget.
Off by default (C None): a cap of 128 took a light tenant's p99 from 7.1x to 1.8x of alone
with 32-token prompts, but with 1,024-token ones its p50 from 1.76x to 3.39x (its own
prompt is capped too) and throughput from 0.88 to 0.59 of first come, first served. W = 1
by default: a wider window also caps the step in flight when another tenant's request
comes, at a cost in throughput (both: benchmarks/RESULTS.md).
Bound: a step that runs a tenant's work carries at most (k - 1) * C prefill positions of
the other k - 1 tenants with work, beside one decode token per running sequence,
whatever they queue (``tests/engine/test_fair_share.py`` checks it).
A sequence held back by its own tenant's cap waits for that tenant's own chunks, C
positions a step, and is outside the bound above as a skipped one is.

Not yet (issue 47 item 4): async scheduling as vLLM's, scheduling and preparing
step N+1 while step N runs on the device. Step N+1 would be scheduled before N's
tokens are known, so: every running sequence is assumed to decode one more token
(its slot allocated ahead; a sequence that step N finishes is dropped from N+1's
outputs and its extra block freed); N+1's input token ids are filled on the
device from N's sampled tokens (a gather, no host round trip); stop checks and
outputs of N run on the host while N+1 runs. How it fits the fair share: each
chunk records its charge (``ScheduledSeq.charge``), so the chunk of a sequence
that step N finishes is refunded (``Scheduler.refund``) when N+1 drops it;
admissions for N+1 then read counters that hold up to one speculated token per
running sequence not yet refunded: the bound above grows by at most
max_num_seqs * output_cost / w_f. Preemption for N+1 picks its victim from counters
and blocks known when N+1 is scheduled, never from N's outcome; a sequence N
finishes frees its blocks only after N+1 is scheduled (its extra block too).
Forks (n > 1) happen when N's first token is sampled, after N+1 was scheduled:
the children join at N+2 (running while a slot is free, else waiting).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from lorapool.engine.block_manager import BlockManager
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
    # while two or more tenants have work, the most prompt or recompute positions one
    # tenant's chunks take in a step (module docstring); None: no cap
    contended_prefill_tokens: int | None = None
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
        self.ledger = Ledger(config.input_cost, config.output_cost)
        self._cap: int | None = None  # this step's contended prefill cap, if any
        self._prefill: dict[str, int] = {}  # prefill positions this step, by tenant
        self._steps = 0
        self._seen: dict[str, int] = {}  # tenant -> the last step it had work at

    def add(self, seq: Sequence) -> None:
        self.ledger.join(seq.request.tenant)
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def starving(self) -> bool:
        """Some waiting sequence was skipped ``starvation_steps`` times: newcomers wait."""
        limit = self.config.starvation_steps
        return any(n >= limit for n in self.num_skipped.values())

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self._cap = self.config.contended_prefill_tokens if self._contended() else None
        self._prefill = {}
        if self.config.fair_share and self.waiting:
            self._make_room(out)
        made_room = len(out.preempted)
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        if len(out.preempted) == made_room:  # no preemption for want of blocks
            self._schedule_waiting(out, budget)
        return out

    def _contended(self) -> bool:
        """Two or more tenants had work within the last ``contended_window_steps`` steps
        (this one included)."""
        if not self.config.fair_share:
            return False
        self._steps += 1
        seen, now = self._seen, self._steps
        for tenant in self.ledger.active:
            seen[tenant] = now
        if len(seen) > len(self.ledger.active):  # forget those past the window
            oldest = now - self.config.contended_window_steps
            self._seen = seen = {t: at for t, at in seen.items() if at > oldest}
        return len(seen) > 1

    def _make_room(self, out: SchedulerOutput) -> None:
        """A tenant with nothing running waits while every slot is taken: preempt one
        sequence for it (``fair_share.room_victim`` says which, and when)."""
        config = self.config
        seq = room_victim(
            self.running, self.waiting, self.ledger, self.num_skipped, config.max_num_seqs
        )
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
            if self._cap is not None:
                num_new = self._prefill_room(seq, seq.num_computed_tokens, num_new)
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
        if not self.waiting or len(self.running) >= self.config.max_num_seqs or not budget:
            return  # most decode steps: no need to look at the running adapters
        active = {s.lora_int_id for s in self.running} - {0}
        blocked_new_adapters = False
        for seq in self._offer_order():
            if budget == 0 or len(self.running) >= self.config.max_num_seqs:
                break
            if not self._adapter_fits(seq, active, blocked_new_adapters):
                blocked_new_adapters |= self._note_skipped(seq)
                continue
            room = budget
            if self._cap is not None:
                room = self._prefill_room(seq, 0, budget)
                if room <= 0:  # its tenant's prefill cap is spent: its own work, next step
                    continue
            num_new = self._start(seq, room)
            if num_new is None:  # no blocks for it yet: later ones that fit may go first
                if self._note_skipped(seq):  # until it starves: then nothing goes ahead
                    break
                continue
            self.waiting.remove(seq)
            self.num_skipped.pop(seq.seq_id, None)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self._admit_tokens(seq, num_new, out)
            active.add(seq.lora_int_id)
            active.discard(0)
            budget -= num_new

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

    def _prefill_room(self, seq: Sequence, start: int, num_new: int) -> int:
        """``num_new`` cut to the prefill positions ``seq``'s tenant may still take this
        step (the contended cap); a decode token (one, at an output position) is not."""
        if num_new == 1 and start >= seq.request.num_prompt_tokens:
            return num_new
        return min(num_new, self._cap - self._prefill.get(seq.request.tenant, 0))

    def _charged(self, seq: Sequence, num_new: int) -> ScheduledSeq:
        """The step's chunk of ``seq``, charged to its tenant (with the fair share on)."""
        start, request = seq.num_computed_tokens, seq.request
        if self._cap is not None and (num_new > 1 or start < request.num_prompt_tokens):
            self._prefill[request.tenant] = self._prefill.get(request.tenant, 0) + num_new
        if not self.config.fair_share:
            return ScheduledSeq(seq, start, num_new)
        cost = self.ledger.cost(request.num_prompt_tokens, start, num_new)
        return ScheduledSeq(
            seq, start, num_new, self.ledger.charge(request.tenant, request.weight, cost)
        )

    def refund(self, item: ScheduledSeq) -> None:
        """Give back what ``item`` was charged: a speculated token its sequence never
        used (async scheduling, see the module's docstring)."""
        self.ledger.refund(item.seq.request.tenant, item.charge)
        item.charge = 0.0

    def _start(self, seq: Sequence, budget: int) -> int | None:
        """Its cached prefix and its first chunk's size; None, holding nothing, if no room."""
        manager = self.block_manager
        # prompt logprobs need every prompt position computed: no cache for those
        wants_all = seq.request.params.prompt_logprobs is not None
        cached = 0 if wants_all else manager.acquire_prefix(seq)
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
        if len(self.running) >= self.config.max_num_seqs:
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
            self.ledger.leave(seq.request.tenant)
        elif seq in self.waiting:
            self.waiting.remove(seq)
            self.ledger.leave(seq.request.tenant)
        self.num_skipped.pop(seq.seq_id, None)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
