"""Incremental detokenization against ``tokenizer.decode``, with stop strings."""

import random

import pytest
from transformers import AutoTokenizer

from lorapool.engine.detokenizer import IncrementalDetokenizer
from lorapool.protocol import SamplingParams

TEXTS = [
    "Le café est très chaud, l'élève préfère le thé glacé à la crème brûlée.",
    "日本語のテキストも少し入れます。我们在这里测试中文字符。서울은 큰 도시입니다.",
    "Emoji: 🙂 🚀 🎉 👍🏽 ❤️ and a family 👨‍👩‍👧 in one line. ∑ x² ≈ π · r²",
    "def add(a, b):\n    return a + b\n\n  spaces   and\ttabs  ",
    "<|im_start|>assistant\nGrüße aus München<|im_end|>\n<|im_end|>",
]


@pytest.fixture(params=["smollm2", "tiny"])
def tokenizer(request):
    if request.param == "smollm2":
        return request.getfixturevalue("smollm2_tokenizer")
    return AutoTokenizer.from_pretrained(request.getfixturevalue("tiny_tokenizer_path"))


def stream(tokenizer, ids, params, chunks=None, check_stop=True):
    """Feed ``ids`` in chunks; the detokenizer and the deltas taken while streaming."""
    detok = IncrementalDetokenizer(tokenizer, [1, 2, 3], params)
    chunks = chunks or [1] * len(ids)
    deltas, start = [], 0
    for size in chunks:
        stop = detok.add_tokens(ids[start : start + size], check_stop=check_stop)
        start += size
        deltas.append(detok.take_delta(finished=stop is not None))
        if stop is not None:
            break
    deltas.append(detok.take_delta(finished=True))
    return detok, deltas


def random_chunks(n, rng):
    chunks = []
    while sum(chunks) < n:
        chunks.append(rng.randint(1, 5))
    return chunks


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("text", TEXTS)
def test_one_token_at_a_time_equals_decode(tokenizer, text, skip_special_tokens):
    ids = tokenizer.encode(text, add_special_tokens=False)
    params = SamplingParams(skip_special_tokens=skip_special_tokens)
    detok, deltas = stream(tokenizer, ids, params)
    expected = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    assert "".join(deltas) == detok.output_text == expected
    assert not any("\ufffd" in d for d in deltas)
    assert detok.token_ids == ids and detok.stop_reason is None


@pytest.mark.parametrize("seed", range(4))
def test_random_chunks_equal_decode(tokenizer, seed):
    rng = random.Random(seed)
    ids = tokenizer.encode(" ".join(TEXTS), add_special_tokens=False)
    detok, deltas = stream(tokenizer, ids, SamplingParams(), random_chunks(len(ids), rng))
    assert "".join(deltas) == detok.output_text == tokenizer.decode(ids, skip_special_tokens=True)
    assert not any("\ufffd" in d for d in deltas)


@pytest.mark.parametrize("seed", range(3))
def test_random_token_soup_equals_decode(tokenizer, seed):
    """Any token sequence, invalid UTF-8 included: the text is still decode's."""
    rng = random.Random(seed)
    ids = [rng.randrange(len(tokenizer)) for _ in range(120)]
    detok, deltas = stream(tokenizer, ids, SamplingParams(), random_chunks(len(ids), rng))
    assert "".join(deltas) == detok.output_text == tokenizer.decode(ids, skip_special_tokens=True)


def test_a_pending_character_is_flushed_when_finished(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids = tok.encode("ok 🚀", add_special_tokens=False)
    head = ids[:-1]  # the rocket's last byte is missing
    detok = IncrementalDetokenizer(tok, [], SamplingParams())
    detok.add_tokens(head)
    assert "\ufffd" not in detok.take_delta(finished=False)
    assert detok.output_text == tok.decode(head) and detok.output_text.endswith("\ufffd")
    detok.add_tokens(ids[-1:])
    assert detok.output_text == "ok 🚀"


def split_stop_tokens(tokenizer, text, stop):
    """The ids of ``text``, checking that no single token holds all of ``stop``."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert not any(stop in tokenizer.decode([t]) for t in ids)
    return ids


STOP_CASES = [
    ("The answer is 42. Then more text follows.", "answer is"),
    ("Le café est très chaud, vraiment très chaud.", "très chaud"),
    ("我们在这里测试中文字符，模型需要正确地处理它们。", "中文字符"),
    ("Emoji: 🙂 🚀 🎉 and more 🚀 🎉", "🚀 🎉"),
]


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize(("text", "stop"), STOP_CASES)
def test_stop_string_across_token_boundaries(tokenizer, text, stop, include):
    ids = split_stop_tokens(tokenizer, text, stop)
    params = SamplingParams(stop=["never here", stop], include_stop_str_in_output=include)
    detok, deltas = stream(tokenizer, ids, params)
    cut = text.index(stop) + (len(stop) if include else 0)
    assert detok.stop_reason == stop
    assert detok.output_text == text[:cut]
    assert "".join(deltas) == text[:cut]
    # The tokens consumed end with the one that completed the stop string.
    assert stop in tokenizer.decode(detok.token_ids)
    assert stop not in tokenizer.decode(detok.token_ids[:-1])


@pytest.mark.parametrize(("text", "stop"), STOP_CASES)
def test_nothing_after_a_stop_leaks_while_streaming(tokenizer, text, stop):
    ids = split_stop_tokens(tokenizer, text, stop)
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=[stop, "xyzzy-long-stop"]))
    streamed = ""
    for t in ids:
        detok.add_tokens([t])
        streamed += detok.take_delta(finished=False)
        assert stop not in streamed
        assert text.startswith(streamed)
    streamed += detok.take_delta(finished=True)
    assert streamed == text[: text.index(stop)]
    assert detok.add_tokens(ids) is None and detok.output_text == streamed
    assert detok.take_delta(finished=True) == ""


def test_stop_in_the_middle_of_a_chunk_drops_the_rest(smollm2_tokenizer):
    tok = smollm2_tokenizer
    text = "one two three four five six"
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=["three"]))
    assert detok.add_tokens(ids) == "three"
    assert detok.output_text == "one two "
    assert tok.decode(detok.token_ids) == "one two three"


def test_the_earliest_stop_string_wins(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids = tok.encode("hello world and more", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=["world", "o"]))
    assert detok.add_tokens(ids) == "o"
    assert detok.output_text == "hell"


def test_check_stop_false_before_min_tokens(smollm2_tokenizer):
    tok = smollm2_tokenizer
    text = "stop here, then stop again"
    ids = tok.encode(text, add_special_tokens=False)
    first = len(tok.encode("stop here,", add_special_tokens=False))
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=["stop"]))
    assert detok.add_tokens(ids[:first], check_stop=False) is None
    assert detok.add_tokens(ids[first:]) == "stop"
    assert detok.output_text == "stop here, then "


def test_holdback_releases_text_that_cannot_start_a_stop(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids = tok.encode("abcdefghij", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=["1234"]))
    detok.add_tokens(ids)
    assert detok.take_delta(finished=False) == "abcdefg"  # the last 3 characters wait
    assert detok.take_delta(finished=True) == "hij"
    detok = IncrementalDetokenizer(
        tok, [], SamplingParams(stop=["1234"], include_stop_str_in_output=True)
    )
    detok.add_tokens(ids)
    assert detok.take_delta(finished=False) == "abcdefghij"


class CountingBackend:
    """A backend tokenizer that records how many ids each decode gets."""

    def __init__(self, backend):
        self.backend = backend
        self.sizes = []

    def decode(self, ids, skip_special_tokens):
        self.sizes.append(len(ids))
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)


class CountingTokenizer:
    clean_up_tokenization_spaces = False

    def __init__(self, tokenizer):
        self.backend_tokenizer = CountingBackend(tokenizer.backend_tokenizer)


def test_each_token_costs_a_small_window(smollm2_tokenizer):
    tok = CountingTokenizer(smollm2_tokenizer)
    ids = smollm2_tokenizer.encode(" ".join(TEXTS * 4), add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], SamplingParams())
    for t in ids:
        detok.add_tokens([t])
    assert len(ids) > 300
    assert max(tok.backend_tokenizer.sizes) <= 8
    assert len(tok.backend_tokenizer.sizes) <= 2 * len(ids)
