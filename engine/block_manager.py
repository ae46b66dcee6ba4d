"""The paged KV cache's bookkeeping: which blocks each sequence holds. Plain Python.

Blocks are reference counted so that the n samples of one request share their
prompt's blocks; a sequence about to write into a block it shares gets its own
copy first (copy-on-write, reported as (src, dst) pairs for the model runner).
"""

from __future__ import annotations

from collections import deque

from lorapool.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one token, got "
                             f"num_blocks={num_blocks}, block_size={block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self.free_block_ids: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def _num_new_blocks(self, seq: Sequence, num_new_tokens: int) -> int:
        needed = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size)
        return max(0, needed - len(seq.block_table)) + int(self._needs_copy(seq))

    def _needs_copy(self, seq: Sequence) -> bool:
        # The next token lands in the last block, which another sequence shares.
        if seq.num_computed_tokens % self.block_size == 0 or not seq.block_table:
            return False
        last = seq.num_computed_tokens // self.block_size
        return last < len(seq.block_table) and self.ref_counts[seq.block_table[last]] > 1

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether ``num_new_tokens`` more tokens of ``seq`` fit in free blocks."""
        return self._num_new_blocks(seq, num_new_tokens) <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_new_tokens: int) -> list[tuple[int, int]]:
        """Give ``seq`` the slots for its next tokens; returns blocks to copy."""
        copies = []
        if self._needs_copy(seq):
            last = seq.num_computed_tokens // self.block_size
            src = seq.block_table[last]
            dst = self._take_block()
            self._release_block(src)
            seq.block_table[last] = dst
            copies.append((src, dst))
        needed = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size)
        while len(seq.block_table) < needed:
            seq.block_table.append(self._take_block())
        return copies

    def free(self, seq: Sequence) -> None:
        """Return the blocks ``seq`` holds (shared blocks stay until their last holder frees)."""
        for block_id in seq.block_table:
            self._release_block(block_id)
        seq.block_table = []

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """``child`` shares every block of ``parent``."""
        child.block_table = list(parent.block_table)
        for block_id in child.block_table:
            self.ref_counts[block_id] += 1

    def slot(self, seq: Sequence, position: int) -> int:
        """The flat cache slot of token ``position`` of ``seq``."""
        block = seq.block_table[position // self.block_size]
        return block * self.block_size + position % self.block_size

    def _take_block(self) -> int:
        if not self.free_block_ids:
            raise RuntimeError("KV cache out of blocks; the scheduler must check can_allocate")
        block_id = self.free_block_ids.popleft()
        self.ref_counts[block_id] = 1
        return block_id

    def _release_block(self, block_id: int) -> None:
        self.ref_counts[block_id] -= 1
        if self.ref_counts[block_id] == 0:
            self.free_block_ids.append(block_id)
