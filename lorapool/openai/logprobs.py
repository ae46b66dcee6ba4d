"""Token log-probabilities in OpenAI's two shapes: completions' parallel lists and
chat's per-token entries.

A position's logprobs hold the sampled token (``token_ids[i]``) and the top ones
ranked 1..k (which may include it); they come as ``{id: Logprob}`` from a final
output or as the wire's ``[[id, logprob, rank, text], ...]`` from a chunk.
"""

from __future__ import annotations

from typing import Any, NamedTuple


class Entry(NamedTuple):
    token: str
    logprob: float
    rank: int | None


def _entries(position: Any) -> dict[int, Entry]:
    if isinstance(position, dict):
        return {t: Entry(lp.decoded_token or "", lp.logprob, lp.rank) for t, lp in position.items()}
    return {t: Entry(text or "", lp, rank) for t, lp, rank, text in position}


def _positions(token_ids: list[int], logprobs: list | None, k: int):
    """(sampled entry, the top ``k`` entries by rank) per generated token."""
    for token, position in zip(token_ids, logprobs or ()):
        entries = _entries(position or {})
        sampled = entries.get(token, Entry("", float("-inf"), None))
        top = [e for e in entries.values() if e.rank is not None and e.rank <= k]
        yield sampled, sorted(top, key=lambda e: e.rank)


def completion_logprobs(
    token_ids: list[int], logprobs: list | None, k: int, offset: int = 0
) -> dict[str, Any] | None:
    """``{tokens, token_logprobs, top_logprobs, text_offset}`` of /v1/completions, the
    top ``k`` each; ``offset``: characters of the completion before these tokens."""
    if logprobs is None:
        return None
    tokens, values, tops, offsets = [], [], [], []
    for sampled, top in _positions(token_ids, logprobs, k):
        tokens.append(sampled.token)
        values.append(sampled.logprob)
        tops.append({e.token: e.logprob for e in top})
        offsets.append(offset)
        offset += len(sampled.token)
    return {
        "tokens": tokens,
        "token_logprobs": values,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def chat_logprobs(token_ids: list[int], logprobs: list | None, k: int) -> dict[str, Any] | None:
    """``{content: [{token, logprob, bytes, top_logprobs}]}`` of /v1/chat/completions,
    the top ``k`` each."""
    if logprobs is None:
        return None
    return {
        "content": [
            {**_chat_entry(sampled), "top_logprobs": [_chat_entry(e) for e in top]}
            for sampled, top in _positions(token_ids, logprobs, k)
        ]
    }


def _chat_entry(entry: Entry) -> dict[str, Any]:
    return {
        "token": entry.token,
        "logprob": entry.logprob,
        "bytes": list(entry.token.encode("utf-8", "surrogatepass")),
    }


def prompt_logprobs_json(positions: list | None) -> list | None:
    """vLLM's ``prompt_logprobs``: per prompt token None (the first) or ``{token id:
    {"logprob", "rank", "decoded_token"}}``."""
    if positions is None:
        return None
    return [
        None
        if position is None
        else {
            str(t): {"logprob": e.logprob, "rank": e.rank, "decoded_token": e.token}
            for t, e in _entries(position).items()
        }
        for position in positions
    ]


def echo_logprobs(
    prompt_ids: list[int], positions: list | None, k: int, first: str
) -> dict[str, Any] | None:
    """The prompt's part of an echoed completion's logprobs: its first token (``first``,
    its text) has none, as OpenAI's."""
    if positions is None or not prompt_ids:
        return None
    rest = completion_logprobs(prompt_ids[1:], positions[1:], k, len(first))
    return {
        "tokens": [first, *rest["tokens"]],
        "token_logprobs": [None, *rest["token_logprobs"]],
        "top_logprobs": [None, *rest["top_logprobs"]],
        "text_offset": [0, *rest["text_offset"]],
    }


def joined(head: dict[str, Any] | None, tail: dict[str, Any] | None) -> dict[str, Any] | None:
    """Two parts of completions' logprobs as one (the tail's offsets after the head's)."""
    if head is None or tail is None:
        return tail if head is None else head
    return {key: head[key] + tail[key] for key in head}
