"""What one scheduler step decided (``engine.scheduler``): the chunks to run, the blocks
to copy, the sequences preempted. Plain Python; the model runner reads it.

Async scheduling (issue 47 item 4). Done: async output processing
(``engine.async_output``, off by default) makes step N's text and outputs while N+1
runs; its one speculated chunk, that of a sequence a stop string ended, is refunded as
below. Not yet: scheduling and preparing step N+1 while step N runs on the device. Step
N+1 would be scheduled before N's tokens are known, so: every running sequence is
assumed to decode one more token (its slot allocated ahead; a sequence that step N
finishes is dropped from N+1's outputs and its extra block freed); N+1's input token ids
are filled on the device from N's sampled tokens (a gather, no host round trip); stop
checks and outputs of N run on the host while N+1 runs. How it fits the fair share: each
chunk records its charge (``ScheduledSeq.charge``), so the chunk of a sequence that step
N finishes is refunded (``Scheduler.refund``) when N+1 drops it; admissions for N+1 then
read counters that hold up to one speculated token per running sequence not yet
refunded: the scheduler's fair-share bound grows by at most max_num_seqs * output_cost /
w_f. Preemption for N+1 picks its victim from counters and blocks known when N+1 is
scheduled, never from N's outcome; a sequence N finishes frees its blocks only after N+1
is scheduled (its extra block too). Forks (n > 1) happen when N's first token is
sampled, after N+1 was scheduled: the children join at N+2 (in the slots held for them
at admission).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lorapool.engine.sequence import Sequence


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    start: int  # tokens of seq already in the cache before this step
    num_new_tokens: int
    charge: float = 0.0  # added to its tenant's counter (Scheduler.refund gives it back)

    @property
    def samples(self) -> bool:
        """This chunk reaches the end of the sequence's tokens: sample the next one."""
        return self.start + self.num_new_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def lora_ids(self) -> set[int]:
        """Distinct adapters in this step (0, the base model, excluded)."""
        return {s.seq.lora_int_id for s in self.scheduled} - {0}

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
