"""Checks of vLLM's routes that the tiny-model and SmolLM2 pools both run."""

from __future__ import annotations

import httpx


def tokenize_matches_transformers(gateway: str, model: str, name: str) -> None:
    """/tokenize and /detokenize agree with transformers' tokenizer of ``model``."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(model)
    prompt = "Grüße, 日本語 and 🙂 tokens\n  spaced"
    got = httpx.post(
        f"{gateway}/tokenize", json={"model": name, "prompt": prompt, "return_token_strs": True}
    ).json()
    want = hf.encode(prompt, add_special_tokens=True)
    assert got["tokens"] == want and got["count"] == len(want)
    assert got["token_strs"] == hf.convert_ids_to_tokens(want)
    assert isinstance(got["max_model_len"], int) and got["max_model_len"] > 0
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "And again?"},
    ]
    got = httpx.post(f"{gateway}/tokenize", json={"model": name, "messages": chat}).json()
    text = hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert got["tokens"] == hf.encode(text, add_special_tokens=False)
    assert got["token_strs"] is None
    back = httpx.post(f"{gateway}/detokenize", json={"model": name, "tokens": want}).json()
    assert back == {"prompt": hf.decode(want)}
