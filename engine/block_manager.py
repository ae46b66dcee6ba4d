"""The paged KV cache's bookkeeping: which blocks each sequence holds. Plain Python.

Blocks are reference counted so that the n samples of one request share their
prompt's blocks; a sequence about to write into a block it shares gets its own
copy first (copy-on-write, reported as (src, dst) pairs for the model runner).

Prefix caching (``enable_prefix_caching``): once a block is full, and its KV
computed, it is named by a hash of (the previous block's hash, its token ids,
the sequence's adapter id, 0 for the base model), so one adapter's KV never
serves another adapter or the base. A new sequence starts from its longest
run of cached full blocks (``acquire_prefix``). A freed block that has a hash
keeps its KV and stays findable (evictable, least recently freed first) until
a block is needed and no never-used one is left.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque

from lorapool.engine.sequence import Sequence


def hash_block(prev: bytes | None, token_ids: list[int], lora_id: int) -> bytes:
    """The name of a full block: chained over the blocks before it, per adapter."""
    data = array("q", [lora_id, len(token_ids), *token_ids]).tobytes()
    return hashlib.sha256((prev or b"") + data).digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"need at least one block of at least one token, got "
                f"num_blocks={num_blocks}, block_size={block_size}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.free_block_ids: deque[int] = deque(range(num_blocks))  # hold no cached KV
        self.evictable: OrderedDict[int, None] = OrderedDict()  # free, cached, oldest first
        self.block_hashes: list[bytes | None] = [None] * num_blocks
        self.block_loras: list[int] = [0] * num_blocks
        self.hash_to_block: dict[bytes, int] = {}
        self.num_queried_tokens = 0  # prompt tokens looked up in the cache
        self.num_hit_tokens = 0  # of those, served from it

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids) + len(self.evictable)

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

    def fits_in_place(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether the tokens fit in blocks ``seq`` holds alone: nothing to allocate
        or copy (most decode steps). Implies ``can_allocate``; ``allocate`` is a no-op."""
        computed, table, size = seq.num_computed_tokens, seq.block_table, self.block_size
        if computed + num_new_tokens > len(table) * size:
            return False
        return computed % size == 0 or self.ref_counts[table[computed // size]] == 1

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
        # Tail first: the tail of a prefix is the least likely to be shared, so evicted first.
        for block_id in reversed(seq.block_table):
            self._release_block(block_id)
        seq.block_table = []

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """``child`` shares every block of ``parent``."""
        child.block_table = list(parent.block_table)
        for block_id in child.block_table:
            self.ref_counts[block_id] += 1

    def share_prompt(self, seq: Sequence) -> int:
        """Start a sequence holding no blocks (a sample that forked with no slot free, or
        was preempted) from the full blocks of its prompt that a running sibling holds,
        computed: the KV is the same, as is the adapter. Returns the tokens shared."""
        if seq.block_table:
            return 0
        size = self.block_size
        full = min(seq.num_prompt_tokens, seq.num_tokens - 1) // size
        for sibling in seq.request.seqs:
            computed = sibling.num_computed_tokens >= full * size > 0
            if computed and sibling is not seq and len(sibling.block_table) >= full:
                seq.block_table = sibling.block_table[:full]
                for block_id in seq.block_table:
                    self.ref_counts[block_id] += 1
                seq.num_computed_tokens = full * size
                return seq.num_computed_tokens
        return 0

    def slot(self, seq: Sequence, position: int) -> int:
        """The flat cache slot of token ``position`` of ``seq``."""
        block = seq.block_table[position // self.block_size]
        return block * self.block_size + position % self.block_size

    # --- prefix caching ---------------------------------------------------
    def acquire_prefix(self, seq: Sequence) -> int:
        """Start a sequence holding no blocks from its cached prefix; returns its tokens.

        Only full blocks before the last token match: the last token is always
        computed, so that the step can sample from it.
        """
        if not self.enable_prefix_caching or seq.block_table:
            return 0
        blocks = self._cached_prefix(seq)
        for block_id in blocks:
            if self.ref_counts[block_id] == 0:
                del self.evictable[block_id]
            self.ref_counts[block_id] += 1
        seq.block_table = blocks
        seq.num_computed_tokens = len(blocks) * self.block_size
        return seq.num_computed_tokens

    def count_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Statistics: ``num_tokens`` of a new sequence were looked up, this many hit."""
        if not self.enable_prefix_caching:
            return
        self.num_queried_tokens += num_tokens
        self.num_hit_tokens += num_hit_tokens

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        blocks, prev, size = [], None, self.block_size
        for i in range((seq.num_tokens - 1) // size):
            prev = hash_block(prev, seq.token_ids[i * size : (i + 1) * size], seq.lora_int_id)
            block_id = self.hash_to_block.get(prev)
            if block_id is None:
                break
            blocks.append(block_id)
        return blocks

    def cache_blocks(self, seq: Sequence, start: int, end: int) -> None:
        """Tokens ``start:end`` of ``seq`` were computed: name the blocks they filled."""
        if not self.enable_prefix_caching:
            return
        size = self.block_size
        for i in range(start // size, end // size):
            block_id = seq.block_table[i]
            if self.block_hashes[block_id] is not None:
                continue  # came from the cache, or a sibling sequence named it
            prev = self.block_hashes[seq.block_table[i - 1]] if i else None
            if i and prev is None:
                return  # the chain is broken (forget_adapter): name nothing after it
            tokens = seq.token_ids[i * size : (i + 1) * size]
            digest = hash_block(prev, tokens, seq.lora_int_id)
            self.block_hashes[block_id] = digest
            self.block_loras[block_id] = seq.lora_int_id
            # Two sequences may compute the same block at once: the first one is found.
            self.hash_to_block.setdefault(digest, block_id)

    def forget_adapter(self, lora_id: int) -> None:
        """Never serve cached KV of this adapter again (its id may come back as other weights)."""
        for block_id, digest in enumerate(self.block_hashes):
            if digest is not None and self.block_loras[block_id] == lora_id:
                self._unname(block_id)
                if block_id in self.evictable:
                    del self.evictable[block_id]
                    self.free_block_ids.append(block_id)

    # --- blocks -----------------------------------------------------------
    def _take_block(self) -> int:
        if self.free_block_ids:
            block_id = self.free_block_ids.popleft()
        elif self.evictable:
            block_id, _ = self.evictable.popitem(last=False)
            self._unname(block_id)
        else:
            raise RuntimeError("KV cache out of blocks; the scheduler must check can_allocate")
        self.ref_counts[block_id] = 1
        return block_id

    def _release_block(self, block_id: int) -> None:
        self.ref_counts[block_id] -= 1
        if self.ref_counts[block_id] > 0:
            return
        digest = self.block_hashes[block_id]
        if digest is not None and self.hash_to_block.setdefault(digest, block_id) == block_id:
            self.evictable[block_id] = None
            return
        self.block_hashes[block_id] = None  # a duplicate of a block that is still cached
        self.free_block_ids.append(block_id)

    def _unname(self, block_id: int) -> None:
        digest = self.block_hashes[block_id]
        if self.hash_to_block.get(digest) == block_id:
            del self.hash_to_block[digest]
        self.block_hashes[block_id] = None
