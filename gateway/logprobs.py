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
