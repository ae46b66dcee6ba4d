"""Incremental detokenization of one completion, with stop strings.

Each new token is decoded within a small window of the latest tokens
(vLLM's prefix / read offsets): ``prefix`` starts the window, so that a
decoder that treats the first token specially (a leading space, a byte
fallback) sees the same context every time; ``read`` ends the text already
settled. Text ending in U+FFFD (an incomplete UTF-8 character) stays pending
until a later token completes it, so a streamed delta never holds half a
character.

The settled text equals ``tokenizer.decode(token_ids, skip_special_tokens=...)``
(plus, while pending, that decode's trailing U+FFFD) unless a stop string cut it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

from lorapool.protocol import SamplingParams

REPLACEMENT_CHAR = "\ufffd"


def make_decode(tokenizer, params: SamplingParams) -> Callable[[list[int]], str]:
    """``ids -> text`` exactly as ``tokenizer.decode`` with ``params``' options.

    transformers' fast tokenizers ignore ``spaces_between_special_tokens`` and
    only post-process when ``clean_up_tokenization_spaces`` is set; otherwise
    the Rust tokenizer is called directly, skipping transformers' overhead.
    """
    skip = params.skip_special_tokens
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return partial(backend.decode, skip_special_tokens=skip)
    if not hasattr(tokenizer, "convert_ids_to_tokens"):  # a bare tokenizers.Tokenizer
        return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip)
    spaces = params.spaces_between_special_tokens
    return lambda ids: tokenizer.decode(
        ids, skip_special_tokens=skip, spaces_between_special_tokens=spaces
    )


class CachedDecode:
    """A ``make_decode`` function that keeps the text of each single token (a pure
    function of the id): most steps the settled window is one token, so each new
    token costs one decode (its window), not two. Shared by the sequences of one
    tokenizer and options; at most one entry per vocabulary token."""

    def __init__(self, decode: Callable[[list[int]], str]):
        self.decode = decode
        self.singles: dict[int, str] = {}

    def __call__(self, ids: list[int]) -> str:
        if len(ids) != 1:
            return self.decode(ids)
        text = self.singles.get(ids[0])
        if text is None:
            text = self.singles[ids[0]] = self.decode(ids)
        return text


class IncrementalDetokenizer:
    """The text of one completion, grown token by token.

    ``token_ids`` are the tokens consumed: after a stop string matched, the
    tokens of that ``add_tokens`` call past the one that completed it are
    dropped. ``prompt_token_ids`` is accepted for vLLM's signature; the text is
    that of the output tokens alone, as ``tokenizer.decode(output_ids)`` gives.
    """

    def __init__(
        self,
        tokenizer,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        decode: Callable[[list[int]], str] | None = None,
    ):
        """``decode``: ``make_decode(tokenizer, params)`` (or a ``CachedDecode`` of it)."""
        self.params = params
        self.token_ids: list[int] = []
        self.stop_reason: str | None = None  # the stop string that ended the text
        self._decode = decode or make_decode(tokenizer, params)
        # windows of several tokens skip CachedDecode's Python call
        self._decode_many = getattr(self._decode, "decode", self._decode)
        self._text = ""  # settled: the text of token_ids[:_read]
        self._prefix = 0
        self._read = 0
        self._prefix_text: str | None = None  # decode(token_ids[_prefix:_read]), cached
        self._taken = 0  # characters handed out by take_delta
        stop = params.stop or []
        self._stops = stop
        self._holdback = 0
        if stop and not params.include_stop_str_in_output:
            self._holdback = max(len(s) for s in stop) - 1

    @property
    def output_text(self) -> str:
        """The whole text so far, including a pending incomplete character."""
        if self.stop_reason is not None or self._read == len(self.token_ids):
            return self._text
        window = self._decode(self.token_ids[self._prefix :])
        return self._text + window[len(self._window_prefix()) :]

    @property
    def stopped(self) -> bool:
        return self.stop_reason is not None

    def add_tokens(self, token_ids: Sequence[int], check_stop: bool = True) -> str | None:
        """Append generated tokens; return the stop string matched, if any.

        On a match ``output_text`` is cut before the stop string (after it with
        ``include_stop_str_in_output``) and later tokens are ignored.
        ``check_stop=False`` for tokens generated before ``min_tokens``.
        """
        for token_id in token_ids:
            stop = self.add_token(token_id, check_stop)
            if stop is not None:
                return stop
        return None

    def add_token(self, token_id: int, check_stop: bool = True) -> str | None:
        """``add_tokens([token_id], check_stop)``, the decode step's case.

        Settles what the new token completes: the window from ``_prefix`` decoded,
        less the prefix's text, unless it ends in an incomplete character.
        """
        if self.stop_reason is not None:
            return None
        token_ids = self.token_ids
        token_ids.append(token_id)
        prefix_text = self._prefix_text
        if prefix_text is None:
            prefix_text = self._window_prefix()
        window = self._decode_many(token_ids[self._prefix :])
        num_prefix = len(prefix_text)
        if len(window) <= num_prefix or window[-1] == REPLACEMENT_CHAR:
            return None
        self._text += window[num_prefix:]
        self._prefix, self._read = self._read, len(token_ids)
        self._prefix_text = None
        if check_stop and self._stops and self._check_stop(len(window) - num_prefix):
            return self.stop_reason
        return None

    def take_delta(self, finished: bool) -> str:
        """The text not taken yet.

        While not finished, the last (longest stop string - 1) characters are
        held back, so that a stop string forming across tokens never leaks.
        """
        if finished or self.stop_reason is not None:
            text, end = self.output_text, len(self.output_text)
        else:
            text = self._text
            end = max(self._taken, len(text) - self._holdback)
        delta = text[self._taken : end]
        self._taken = end
        return delta

    def _window_prefix(self) -> str:
        if self._prefix_text is None:
            self._prefix_text = self._decode(self.token_ids[self._prefix : self._read])
        return self._prefix_text

    def _check_stop(self, num_new: int) -> bool:
        """Cut the text at the earliest stop string that ends in the new characters."""
        old_len = len(self._text) - num_new
        found: tuple[int, str] | None = None
        for stop in self.params.stop or []:
            index = self._text.find(stop, max(0, old_len - len(stop) + 1))
            if index != -1 and (found is None or index < found[0]):
                found = (index, stop)
        if found is None:
            return False
        index, stop = found
        end = index + len(stop) if self.params.include_stop_str_in_output else index
        self._text = self._text[:end]
        self.stop_reason = stop
        return True
