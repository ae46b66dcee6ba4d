"""What one scheduler step decided (``engine.scheduler``): the chunks to run, the blocks
to copy, the sequences preempted. Plain Python; the model runner reads it.

Async scheduling (issue 47 item 4): ``engine.async_scheduling`` (off by default) schedules
and packs step N+1 and queues its forward before a greedy step N's tokens are read
back. Step N+1 is scheduled before N's tokens are known, so: every sequence N samples
for holds a placeholder token, as if it decoded one more (its slot allocated ahead; a
sequence that N finishes is dropped from N+1's outputs and its blocks freed when N
lands); N+1's input ids take N's tokens on the device (a gather, no host round trip);
stop checks and outputs of N run on the host while N+1 runs. How it fits the fair
share: each chunk records its charge (``ScheduledSeq.charge``), so the chunk of a
sequence that step N finishes is refunded (``Scheduler.refund``) when N lands; N+1's
admissions read counters that hold up to one speculated token per running sequence not
yet refunded: the scheduler's fair-share bound grows by at most max_num_seqs *
output_cost / w_f, and such a sequence takes a slot of N+1. Preemption for N+1 picks its
victim from counters and blocks known when N+1 is scheduled, never from N's outcome.
Steps that sample, fork (n > 1) or follow a grammar are not left in flight: they land
the step before them first. Async output processing (``engine.async_output``, off by
default, exclusive with it) makes step N's text and outputs while N+1 runs in the
synchronous schedule; its one speculated chunk, that of a sequence a stop string
ended, is refunded the same way.
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
