"""The engine checks an adapter's files against its registry record when a request
names it (``LoRAManager.check``, the worker's intake): loaded when the CPU cache has
room, else read and hashed without evicting anything, and then held to that identity
when it loads. The oracle: hashlib over the weights file, ``identity_of`` the config."""

import hashlib
import json
import shutil

import pytest
import torch
from adapters import build_adapter

from lorapool.adapter_config import identity_of
from lorapool.engine.config import EngineArgs
from lorapool.engine.loader import load_model
from lorapool.engine.lora.adapter import AdapterError
from lorapool.engine.lora.manager import LoRAManager
from lorapool.protocol import LoRARequest
from lorapool.records.adapter import AdapterRecord


@pytest.fixture(scope="module")
def folders(base, tmp_path_factory):
    root = tmp_path_factory.mktemp("identity")
    return [build_adapter(base, root / f"a{i}", rank=4, alpha=16, seed=i) for i in range(3)]


def files_identity(path):
    weights = hashlib.sha256((path / "adapter_model.safetensors").read_bytes()).hexdigest()
    return identity_of(json.loads((path / "adapter_config.json").read_text()), weights)


def full_manager(base, folders):
    """A manager whose CPU cache (2) is full with adapters 1 and 2."""
    args = EngineArgs(model=str(base), enable_lora=True, max_loras=2, max_lora_rank=8)
    m = LoRAManager(load_model(base)[0], args, torch.device("cpu"), torch.float32)
    for i, path in enumerate(folders[:2], start=1):
        m.check(LoRARequest(f"a{i}", i, str(path)), files_identity(path))
    assert m.list_loras() == {1, 2}
    return m


def edit_alpha(path, alpha):
    config = json.loads((path / "adapter_config.json").read_text())
    (path / "adapter_config.json").write_text(json.dumps({**config, "lora_alpha": alpha}))


def test_a_full_cache_checks_the_files_without_evicting(base, folders, tmp_path):
    m = full_manager(base, folders)
    path = shutil.copytree(folders[2], tmp_path / "third")
    registered = files_identity(path)
    request = LoRARequest("third", 3, str(path))
    assert m.check(request, registered) == registered
    assert m.list_loras() == {1, 2}  # nothing evicted, nothing loaded
    edit_alpha(path, 1600)  # after the check, before the load: the load refuses it
    errors = m.activate([request])
    assert "lora_alpha 16.0 -> 1600.0" in str(errors[3, str(path)])


def test_a_full_cache_refuses_changed_files_at_once(base, folders, tmp_path):
    m = full_manager(base, folders)
    path = shutil.copytree(folders[2], tmp_path / "third")
    old = AdapterRecord("third", 3, str(path), files_identity(path).sha256, 4, 16.0,
                        ("q_proj", "v_proj"))  # fmt: skip
    edit_alpha(path, 1600)
    with pytest.raises(AdapterError, match=r"lora_alpha 16\.0 -> 1600\.0"):
        m.check(LoRARequest("third", 3, str(path)), old)
    assert m.list_loras() == {1, 2}


def test_a_full_cache_reads_an_unloaded_adapters_files_once(base, folders, tmp_path, monkeypatch):
    """Requests for an adapter the full cache cannot take yet read its files once, not
    once each: the identity read is held to at its load anyway."""
    from lorapool.engine.lora import manager as manager_module

    m = full_manager(base, folders)
    path = shutil.copytree(folders[2], tmp_path / "third")
    registered, reads = files_identity(path), []
    real = manager_module.read_identity
    monkeypatch.setattr(manager_module, "read_identity", lambda *a: reads.append(a) or real(*a))
    request = LoRARequest("third", 3, str(path))
    for _ in range(5):
        assert m.check(request, registered) == registered
    assert len(reads) == 1
    edit_alpha(path, 1600)  # still refused at its load
    assert "lora_alpha 16.0 -> 1600.0" in str(m.activate([request])[3, str(path)])
