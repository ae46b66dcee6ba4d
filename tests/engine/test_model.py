"""Our forward pass against transformers' on tiny random models.

Each scenario runs packed batches over a paged KV cache with shuffled block
tables and compares the logits of every new token with the logits that
transformers computes over the whole sequence at once.
"""

import hashlib
import random
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file
from tiny_models import build_tiny_model
from transformers import AutoModelForCausalLM, GPT2Config

from lorapool.engine.batch import BatchMetadata
from lorapool.engine.loader import load_model, weights_sha256
from lorapool.engine.models.args import rope_settings, sliding_window

ATOL = 1e-4
NUM_BLOCKS = 64

# (arch, tie_word_embeddings, shard, block_size)
MODELS = [
    ("llama", False, True, 16),
    ("llama", True, False, 32),
    ("llama3", False, False, 32),
    ("llama3", True, False, 16),
    ("mistral", False, False, 16),
    ("mistral", True, False, 32),
    ("qwen2", False, False, 32),
    ("qwen2", True, False, 16),
    ("qwen3", False, False, 16),
    ("qwen3", True, False, 32),
]


class PagedSession:
    """Sequences with a paged KV cache, stepped through our model, checked against HF."""

    def __init__(self, model, hf_model, token_ids: list[list[int]], block_size: int, seed=0):
        self.model, self.hf_model = model, hf_model
        self.token_ids = token_ids
        self.block_size = block_size
        self.done = [0] * len(token_ids)  # tokens already in the cache
        self.free_blocks = list(range(NUM_BLOCKS))
        random.Random(seed).shuffle(self.free_blocks)
        self.tables: list[list[int]] = [[] for _ in token_ids]
        shape = model.kv_cache_shape(NUM_BLOCKS, block_size)
        self.kv_caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(model.num_layers)]
        with torch.no_grad():
            self.expected = [hf_model(torch.tensor([ids])).logits[0] for ids in token_ids]

    def step(self, num_new: dict[int, int]) -> None:
        """Run one packed step with ``num_new[seq]`` new tokens per sequence; check logits."""
        chunks = []
        for seq, n in num_new.items():
            start = self.done[seq]
            self._allocate(seq, start + n)
            chunks.append((self.token_ids[seq][start : start + n], start, self.tables[seq]))
            self.done[seq] += n
        batch = make_batch(chunks, self.block_size)
        hidden = self.model(batch, self.kv_caches)
        logits = self.model.compute_logits(hidden[batch.logits_indices])
        assert logits.dtype == torch.float32
        expected = torch.cat(
            [
                self.expected[seq][start : start + len(ids)]
                for seq, (ids, start, _) in zip(num_new, chunks)
            ]
        )
        torch.testing.assert_close(logits, expected, atol=ATOL, rtol=1e-4)

    def _allocate(self, seq: int, num_tokens: int) -> None:
        while len(self.tables[seq]) * self.block_size < num_tokens:
            self.tables[seq].append(self.free_blocks.pop())


def make_batch(chunks: list[tuple[list[int], int, list[int]]], block_size: int) -> BatchMetadata:
    """BatchMetadata for (new token ids, start position, block table) per sequence.

    Logits are asked for every token.
    """
    ids, positions, slots, lens, starts = [], [], [], [], [0]
    for new_ids, start, table in chunks:
        pos = list(range(start, start + len(new_ids)))
        ids += new_ids
        positions += pos
        slots += [table[p // block_size] * block_size + p % block_size for p in pos]
        lens.append(start + len(new_ids))
        starts.append(starts[-1] + len(new_ids))
    width = max(len(table) for _, _, table in chunks)
    tables = [table + [0] * (width - len(table)) for _, _, table in chunks]
    return BatchMetadata(
        input_ids=torch.tensor(ids),
        positions=torch.tensor(positions),
        slot_mapping=torch.tensor(slots),
        block_tables=torch.tensor(tables, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        logits_indices=torch.arange(len(ids)),
    )


@pytest.fixture(scope="module", params=MODELS, ids=lambda m: f"{m[0]}-tied{m[1]}-bs{m[3]}")
def models(request, tmp_path_factory):
    arch, tied, shard, block_size = request.param
    path = build_tiny_model(
        arch, tmp_path_factory.mktemp(arch), tie_word_embeddings=tied, shard=shard
    )
    model, config = load_model(path)
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert config.tie_word_embeddings == tied
    return model, hf_model, block_size


def random_sequences(lengths: list[int], vocab_size: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(n)] for n in lengths]


def test_prefill_then_decode(models):
    model, hf_model, block_size = models
    lengths = [5, 17, 40, 1]
    token_ids = random_sequences([n + 4 for n in lengths], model.vocab_size)
    session = PagedSession(model, hf_model, token_ids, block_size)
    session.step(dict(enumerate(lengths)))
    for _ in range(4):
        session.step(dict.fromkeys(range(len(lengths)), 1))


def test_chunked_prefill_mixed_with_decode(models):
    model, hf_model, block_size = models
    token_ids = random_sequences([75, 12, 30], model.vocab_size, seed=1)
    session = PagedSession(model, hf_model, token_ids, block_size, seed=1)
    session.step({0: 20, 1: 10})
    session.step({0: 33, 1: 1, 2: 7})
    session.step({2: 20, 0: 22, 1: 1})
    session.step({2: 3})


def test_model_attributes(models):
    model, hf_model, _ = models
    config = hf_model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    assert model.num_layers == config.num_hidden_layers
    assert model.kv_cache_shape(4, 16) == (4, 16, config.num_key_value_heads, head_dim)
    assert model.vocab_size == config.vocab_size
    assert model.max_model_len == config.max_position_embeddings
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.output_sizes == [
        config.num_attention_heads * head_dim,
        *[config.num_key_value_heads * head_dim] * 2,
    ]


def test_unsupported_architecture(tmp_path):
    GPT2Config(n_layer=1, n_embd=32, n_head=2, architectures=["GPT2LMHeadModel"]).save_pretrained(
        tmp_path
    )
    with pytest.raises(ValueError, match="GPT2LMHeadModel") as info:
        load_model(tmp_path)
    assert "LlamaForCausalLM" in str(info.value) and "Qwen3ForCausalLM" in str(info.value)


def test_pickle_checkpoint_refused(tmp_path):
    path = build_tiny_model("llama", tmp_path / "m")
    (path / "model.safetensors").unlink()
    (path / "pytorch_model.bin").write_bytes(b"not to be unpickled")
    with pytest.raises(ValueError, match="pickle"):
        load_model(path)


def test_sliding_window_refused(tmp_path):
    path = build_tiny_model("mistral", tmp_path / "m", sliding_window=128)
    with pytest.raises(ValueError, match="sliding"):
        load_model(path)


def test_missing_weight_refused(tmp_path):
    save_file({"model.embed_tokens.weight": torch.zeros(512, 64)}, tmp_path / "w.safetensors")
    path = build_tiny_model("llama", tmp_path / "m")
    (tmp_path / "w.safetensors").replace(path / "model.safetensors")
    with pytest.raises(ValueError, match="lacks"):
        load_model(path)


def test_weights_sha256(tmp_path):
    path = build_tiny_model("qwen3", tmp_path / "m")
    expected = hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()
    assert weights_sha256(path) == expected
    sharded = build_tiny_model("qwen3", tmp_path / "s", shard=True)
    files = sorted(sharded.glob("*.safetensors"))
    assert len(files) > 1
    expected = hashlib.sha256(b"".join(f.read_bytes() for f in files)).hexdigest()
    assert weights_sha256(sharded) == expected


def test_bfloat16_close_to_float32(tmp_path):
    path = build_tiny_model("qwen3", tmp_path / "m")
    model32, _ = load_model(path)
    model16, _ = load_model(path, dtype=torch.bfloat16)
    assert model16.model.embed_tokens.weight.dtype == torch.bfloat16
    logits = []
    for model in (model32, model16):
        token_ids = random_sequences([9], model.vocab_size)[0]
        batch = make_batch([(token_ids, 0, [3])], block_size=16)
        shape = model.kv_cache_shape(4, 16)
        dtype = model.model.norm.weight.dtype
        caches = [
            (torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
            for _ in range(model.num_layers)
        ]
        logits.append(model.compute_logits(model(batch, caches)))
    assert logits[1].dtype == torch.float32
    torch.testing.assert_close(logits[1], logits[0], atol=0.15, rtol=0.05)


@pytest.mark.parametrize(
    "config, expected",
    [
        # transformers 4.x: theta and scaling live in separate attributes
        (
            SimpleNamespace(rope_theta=5e5, rope_scaling={"type": "linear", "factor": 2.0}),
            (5e5, {"rope_type": "linear", "factor": 2.0}),
        ),
        (SimpleNamespace(rope_theta=1e4, rope_scaling=None), (1e4, None)),
        # transformers 5.x: everything in rope_parameters
        (SimpleNamespace(rope_parameters={"rope_theta": 1e6, "rope_type": "default"}), (1e6, None)),
    ],
)
def test_rope_settings_both_config_layouts(config, expected):
    assert rope_settings(config) == expected


@pytest.mark.parametrize(
    "attrs, window",
    [
        (dict(sliding_window=None), None),
        (dict(sliding_window=4096), 4096),
        (dict(sliding_window=4096, use_sliding_window=False), None),
        (dict(sliding_window=4096, layer_types=["full_attention"]), None),
    ],
)
def test_sliding_window(attrs, window):
    assert sliding_window(SimpleNamespace(**attrs)) == window
