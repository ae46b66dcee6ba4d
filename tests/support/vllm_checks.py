"""Checks of vLLM's routes and metrics that the tiny-model and SmolLM2 pools run: tokenizing
against transformers, scraping /metrics, the metric names a PromQL query reads."""

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


def scrape(url: str, headers: dict | None = None) -> tuple[str, dict]:
    from prometheus_client.parser import text_string_to_metric_families

    got = httpx.get(url, headers=headers or {}, timeout=30)
    assert got.status_code == 200, (url, got.status_code, got.text[:200])
    text = got.text
    return text, {f.name: f for f in text_string_to_metric_families(text)}


def value(families: dict, name: str, suffix: str, **labels) -> float:
    family = families.get(name)
    return sum(
        s.value
        for s in (family.samples if family else ())
        if s.name == name + suffix and all(s.labels.get(k) == v for k, v in labels.items())
    )


PROMQL_WORDS = {
    "sum", "max", "min", "avg", "count", "rate", "irate", "increase", "by", "without",
    "histogram_quantile", "clamp_min", "clamp_max", "le", "on", "ignoring", "and", "or",
    "unless", "bool", "offset", "label_values",
}  # fmt: skip


def promql_metrics(expr: str) -> set[str]:
    """The metric names a PromQL expression reads (label matchers, grouping clauses,
    ranges, strings and Grafana variables taken out first)."""
    import re

    expr = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)
    expr = re.sub(r"\{[^}]*\}|\[[^\]]*\]", "", expr)
    expr = re.sub(r"\b(by|without|on|ignoring)\s*\([^)]*\)", "", expr)
    expr = re.sub(r"\$\w+", "", expr)
    expr = re.sub(r"label_values\(([^,)]*),[^)]*\)", r"\1", expr)
    names = set(re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", expr))
    return {n for n in names if n not in PROMQL_WORDS and not re.fullmatch(r"\d.*", n)}
