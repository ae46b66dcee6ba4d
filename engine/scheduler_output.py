"""What one scheduler step decided (``engine.scheduler``): the chunks to run, the blocks
to copy, the sequences preempted. Plain Python; the model runner reads it."""

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
