"""transformers as the oracle: greedy generation and log-softmax of a request run alone."""

from functools import lru_cache

import torch
from transformers import AutoModelForCausalLM


@lru_cache(maxsize=4)
def hf_model(path: str):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.eval()


_GREEDY: dict[tuple, list[int]] = {}


@torch.inference_mode()
def hf_greedy(path, prompt_ids: list[int], max_new_tokens: int, eos_token_id=2) -> list[int]:
    """transformers' generate, greedy, one request alone; the new token ids (memoized)."""
    key = (str(path), tuple(prompt_ids), max_new_tokens, eos_token_id)
    if key not in _GREEDY:
        _GREEDY[key] = _generate(path, prompt_ids, max_new_tokens, eos_token_id)
    return list(_GREEDY[key])


def _generate(path, prompt_ids: list[int], max_new_tokens: int, eos_token_id) -> list[int]:
    model = hf_model(str(path))
    input_ids = torch.tensor([prompt_ids])
    out = model.generate(input_ids, **greedy_options(input_ids, max_new_tokens, eos_token_id))
    return out[0, len(prompt_ids) :].tolist()


def greedy_options(input_ids: torch.Tensor, max_new_tokens: int, eos_token_id) -> dict:
    """``generate`` options for one unpadded request, greedy, stopping at EOS."""
    return dict(
        attention_mask=torch.ones_like(input_ids),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos_token_id,
        pad_token_id=eos_token_id,
        min_new_tokens=0,
    )


@torch.inference_mode()
def hf_log_softmax(path, token_ids: list[int]) -> torch.Tensor:
    """[len(token_ids), vocab] log-probabilities of the next token after each position."""
    model = hf_model(str(path))
    logits = model(torch.tensor([token_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)
