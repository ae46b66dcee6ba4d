"""Tuned launch configurations: the per-device file, the LoRA ops' keys and candidates."""

import json

import pytest
import torch

from lorapool.kernels import lora_configs, lora_ops, tuned

H200 = torch.device("cuda", 0)  # never touched: the device name is patched


@pytest.fixture
def config_dir(tmp_path, monkeypatch):
    """An empty configs folder, a device named "NVIDIA H200 (PCIe)", fresh caches."""
    monkeypatch.setattr(tuned, "CONFIG_DIR", tmp_path)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: "NVIDIA H200 (PCIe)")
    tuned._device_key.cache_clear()
    tuned._configs.cache_clear()
    yield tmp_path
    tuned._device_key.cache_clear()
    tuned._configs.cache_clear()


def _write(folder, ops) -> None:
    body = {"device": "NVIDIA H200 (PCIe)", "ops": ops}
    (folder / "NVIDIA_H200_PCIe.json").write_text(json.dumps(body))


def test_cpu_has_no_tuned_configs():
    assert tuned.lookup(torch.device("cpu"), "lora_linear", "t16-h576-r16-s3") is None


def test_lookup_reads_the_device_file_once(config_dir):
    assert tuned.device_key(H200) == "NVIDIA_H200_PCIe"
    assert tuned.config_path(H200) == config_dir / "NVIDIA_H200_PCIe.json"
    assert tuned.lookup(H200, "lora_linear", "k") is None  # no file yet
    tuned._configs.cache_clear()
    _write(config_dir, {"lora_linear": {"k": {"SPLIT_K": 4, "num_warps": 8}}})
    assert tuned.lookup(H200, "lora_linear", "k") == {"SPLIT_K": 4, "num_warps": 8}
    assert tuned.lookup(H200, "lora_linear", "other") is None
    assert tuned.lookup(H200, "lora_shrink", "k") is None
    _write(config_dir, {})  # read once per device model: a process keeps what it started with
    assert tuned.lookup(H200, "lora_linear", "k") == {"SPLIT_K": 4, "num_warps": 8}


def test_config_key_format():
    assert lora_ops.config_key(13, 16, 3, hidden=4096) == "t16-h4096-r16-s3"
    assert lora_ops.config_key(1, 8, 2, widths=(4096, 1024)) == "t1-r8-s2-w4096_1024"
    key = lora_ops.config_key(200, 64, 1, hidden=576, widths=[576])
    assert key == "t256-h576-r64-s1-w576"


def test_resolve_prefers_the_callers_config_then_the_tuned_one(config_dir):
    shape = dict(num_tokens=16, rank=16, num_slices=3, hidden=576, widths=(576, 192, 192))
    _write(config_dir, {"lora_linear": {"t16-h576-r16-s3-w576_192_192": {"BLOCK_K": 64}}})
    assert lora_configs.resolve("lora_linear", None, H200, **shape) == {"BLOCK_K": 64}
    assert lora_configs.resolve("lora_linear", {"SPLIT_K": 2}, H200, **shape) == {"SPLIT_K": 2}
    assert lora_configs.resolve("lora_linear", None, torch.device("cpu"), **shape) == {}
    other = dict(shape, num_tokens=17)  # bucket 32: not measured
    assert lora_configs.resolve("lora_linear", None, H200, **other) == {}


def test_a_bad_tuned_entry_is_refused(config_dir):
    _write(config_dir, {"lora_shrink": {"t1-h64-r8-s1": {"BLOCK_K": 48}}})
    shape = dict(num_tokens=1, rank=8, num_slices=1, hidden=64)
    with pytest.raises(ValueError, match="power of two"):
        lora_configs.resolve("lora_shrink", None, H200, **shape)


@pytest.mark.parametrize(
    "op, hidden, widths, count",
    [
        ("lora_shrink", 4096, None, 64),
        ("lora_expand", None, (4096, 1024, 1024), 12),
        ("lora_linear", 4096, (4096, 1024, 1024), 192),
        # BLOCK_K 32/64/128 with splits up to its 4/2/1 K blocks, BLOCK_N 32 only; 4 launch options
        ("lora_linear", 100, (24,), (3 + 2 + 1) * 1 * 4),
    ],
)
def test_candidates(op, hidden, widths, count):
    found = lora_ops.candidates(op, hidden=hidden, widths=widths)
    assert len(found) == count
    assert all(set(c) == set(lora_configs.FIELDS[op]) for c in found)
    assert len({tuple(sorted(c.items())) for c in found}) == count
    if hidden is not None:
        assert all(c["SPLIT_K"] * c["BLOCK_K"] < hidden + c["BLOCK_K"] for c in found)
