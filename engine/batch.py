"""The metadata of one forward step over a flat (packed) batch of tokens.

T is the number of tokens in the step, B the number of sequences, S the
number of tokens whose logits are needed.
"""

from dataclasses import dataclass, fields

import torch

from lorapool.kernels import AttentionPlan


@dataclass
class BatchMetadata:
    """Everything the model's forward pass needs besides the weights and the KV cache.

    The tokens of sequence b are ``input_ids[query_start_loc[b]:query_start_loc[b + 1]]``.
    """

    input_ids: torch.Tensor
    """[T] int64, the new tokens of every sequence, packed back to back."""
    positions: torch.Tensor
    """[T] int64, the position of each token in its sequence."""
    slot_mapping: torch.Tensor
    """[T] int64, flat KV slot of each token: block_id * block_size + offset."""
    block_tables: torch.Tensor
    """[B, max_blocks] int32, the KV blocks of each sequence in order (padded)."""
    seq_lens: torch.Tensor
    """[B] int32, context length of each sequence including its new tokens."""
    query_start_loc: torch.Tensor
    """[B + 1] int32, cumulative new-token counts; starts at 0, ends at T."""
    logits_indices: torch.Tensor
    """[S] int64, indices into the T tokens whose logits are computed."""
    lora_slots: torch.Tensor | None = None
    """[T] int32, adapter slot of each token; -1 means the base model."""
    attention_plan: AttentionPlan | None = None
    """The CPU attention's gathers and masks, built once for every layer of the step."""
    uses_lora: bool = False
    """Whether a token of the step has an adapter (known on the host, no device sync)."""

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    def to(self, device: torch.device | str) -> "BatchMetadata":
        """A copy with every tensor on ``device`` (copies are non-blocking), and no
        attention plan (it holds host tensors: build it on the copy if needed)."""
        moved = {}
        for field in fields(self):
            value = getattr(self, field.name)
            if isinstance(value, torch.Tensor):
                value = value.to(device, non_blocking=True)
            moved[field.name] = value if field.name != "attention_plan" else None
        return BatchMetadata(**moved)
