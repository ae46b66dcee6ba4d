import pytest
from tiny_tokenizer import build_tiny_tokenizer
from transformers import AutoTokenizer

TEXTS = [
    "Le café est très chaud.",
    "東京は日本の首都です。",
    "Emoji 🙂 🚀 👍🏽!",
    "naïve façade ∑ π",
]


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenizer_path):
    return AutoTokenizer.from_pretrained(tiny_tokenizer_path)


def test_vocab_size_is_exact(tokenizer):
    assert len(tokenizer) == 512
    assert max(tokenizer.get_vocab().values()) == 511


@pytest.mark.parametrize("vocab_size", [300, 1024])
def test_other_vocab_sizes_are_exact(tmp_path, vocab_size):
    path = build_tiny_tokenizer(tmp_path, vocab_size=vocab_size)
    assert len(AutoTokenizer.from_pretrained(path)) == vocab_size


def test_too_large_a_vocab_is_refused(tmp_path):
    with pytest.raises(ValueError, match="vocab_size"):
        build_tiny_tokenizer(tmp_path, vocab_size=4096)


def test_special_token_ids(tokenizer):
    ids = tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    assert ids == [0, 1, 2]
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (1, 2, 2)
    ids = tokenizer.encode("<|im_start|>hi<|im_end|>", add_special_tokens=False)
    assert (ids[0], ids[-1]) == (1, 2)


@pytest.mark.parametrize("text", TEXTS)
def test_multibyte_text_round_trips(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text


def test_some_character_spans_several_tokens(tokenizer):
    spans = {char: tokenizer.encode(char, add_special_tokens=False) for char in "éü日本🙂🚀"}
    assert any(len(ids) > 1 for ids in spans.values()), spans
    # decoding a prefix of such a character alone gives the replacement character
    ids = spans["🙂"]
    assert len(ids) > 1 and "\ufffd" in tokenizer.decode(ids[:1])


def test_chat_template_renders(tokenizer):
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_build_is_deterministic(tmp_path):
    first = build_tiny_tokenizer(tmp_path / "a") / "tokenizer.json"
    second = build_tiny_tokenizer(tmp_path / "b") / "tokenizer.json"
    assert first.read_bytes() == second.read_bytes()
