"""A tiny byte-level BPE tokenizer, trained in-process on a fixed corpus.

Shaped like SmolLM2's: ``<|endoftext|>``=0, ``<|im_start|>``=1 (bos),
``<|im_end|>``=2 (eos and pad), a ChatML chat template. The corpus holds
accented, CJK and emoji text, so some characters span several tokens, which
is what incremental detokenization must cope with.
"""

from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A small language model answers questions about the weather, numbers and code.",
    "Many adapters share one base model; each request names the adapter it wants.",
    "Workers pull jobs from a queue, run them in batches, and stream tokens back.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))  # 5",
    "SELECT name, count(*) FROM orders WHERE total > 100 GROUP BY name;",
    "user: What is the capital of France?\nassistant: Paris is the capital of France.",
    "Once upon a time there was a tiny model that learned to count: one, two, three.",
    "Le café est très chaud, l'élève préfère le thé glacé à la crème brûlée.",
    "Größe, Übermut und schöne Grüße aus München; the naïve façade of the résumé.",
    "¿Dónde está la estación? Mañana vamos a la montaña con Señor Núñez.",
    "日本語のテキストも少し入れます。東京は日本の首都です。",
    "我们在这里测试中文字符，模型需要正确地处理它们。",
    "한국어 문장도 조금 있습니다. 서울은 큰 도시입니다.",
    "Emoji: 🙂 🚀 🎉 👍🏽 ❤️ and a family 👨‍👩‍👧 in one line.",
    "Ελληνικά γράμματα: α β γ δ, and Cyrillic: привет, мир!",
    "Math: ∑ x² ≈ π · r², 3 ≤ 4, ∞ ≠ 0, 10 € or £5 or ¥300.",
    "Scheduling decides which sequences run next, how many tokens each one gets,",
    "and which adapters must be resident; the block manager allocates cache pages.",
    "Compliance auditors ask which adapter version produced a given output.",
    "Temperature, top_p and top_k shape sampling; greedy decoding picks the maximum.",
    "Redis streams, consumer groups, acknowledgements and dead letters keep jobs safe.",
    "Bonjour à tous, voilà une phrase française avec des caractères spéciaux: œ, ç, ê.",
]


def build_tiny_tokenizer(path, vocab_size: int = 512) -> Path:
    """Train the tokenizer and save it as a ``PreTrainedTokenizerFast`` directory.

    Deterministic: the same ``vocab_size`` gives the same ``tokenizer.json``.
    The corpus fills up to 1,024 tokens; a larger ``vocab_size`` raises ValueError.
    """
    from transformers import PreTrainedTokenizerFast

    tokenizer = _train(vocab_size)
    if tokenizer.get_vocab_size() != vocab_size:
        got = tokenizer.get_vocab_size()
        raise ValueError(f"the corpus yields {got} tokens, not vocab_size={vocab_size}")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
        unk_token="<|endoftext|>",
        model_max_length=2048,
    )
    fast.chat_template = CHAT_TEMPLATE
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(path)
    return path


def _train(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS * 4, trainer=trainer)
    return tokenizer
