"""Loading and validating PEFT adapters: every rejection names the adapter and the reason."""

import json
import os
import shutil

import pytest
import torch
from adapters import ALL_TARGETS, build_adapter, peft_greedy, set_weight
from safetensors.torch import save_file

from lorapool import LLMEngine, SamplingParams
from lorapool.engine.config import EngineArgs
from lorapool.engine.loader import load_model
from lorapool.engine.lora.adapter import AdapterError
from lorapool.engine.lora.manager import LoRAManager
from lorapool.protocol import LoRARequest


@pytest.fixture(scope="module")
def good(base, tmp_path_factory):
    return build_adapter(
        base, tmp_path_factory.mktemp("good") / "sql", rank=8, targets=ALL_TARGETS, alpha=16
    )


@pytest.fixture(scope="module")
def model(base):
    return load_model(base)[0]


def manager(model, base, roots=(), **kw):
    args = EngineArgs(
        model=str(base),
        enable_lora=True,
        max_loras=2,
        max_lora_rank=16,
        adapter_roots=[str(r) for r in roots],
        **kw,
    )
    return LoRAManager(model, args, torch.device("cpu"), torch.float32)


def copy(good, tmp_path, name="copy"):
    return shutil.copytree(good, tmp_path / name)


def edit_config(path, **changes):
    config = json.loads((path / "adapter_config.json").read_text())
    config.update(changes)
    (path / "adapter_config.json").write_text(json.dumps(config))


def rejects(model, base, path, reason, lora_id=7, roots=()):
    request = LoRARequest("bad-lora", lora_id, str(path))
    with pytest.raises(AdapterError, match=reason) as info:
        manager(model, base, roots).add_lora(request)
    assert "'bad-lora'" in str(info.value) and info.value.lora_request is request


def test_loads_good_adapter_with_identity(model, base, good):
    m = manager(model, base)
    assert m.add_lora(LoRARequest("sql", 1, str(good)))
    adapter = m.get_adapter(1)
    assert adapter.rank == 8 and adapter.scaling == 2.0 and len(adapter.sha256) == 64
    assert adapter.target_modules == sorted(ALL_TARGETS)
    assert m.list_loras() == {1}


def test_missing_directory(model, base, tmp_path):
    rejects(model, base, tmp_path / "nope", "does not exist")


def test_missing_weights_file(model, base, good, tmp_path):
    path = copy(good, tmp_path)
    os.remove(path / "adapter_model.safetensors")
    rejects(model, base, path, "missing adapter_model.safetensors")


def test_missing_config(model, base, good, tmp_path):
    path = copy(good, tmp_path)
    os.remove(path / "adapter_config.json")
    rejects(model, base, path, "missing adapter_config.json")


def test_pickle_weights_never_loaded(model, base, good, tmp_path):
    path = copy(good, tmp_path)
    os.remove(path / "adapter_model.safetensors")
    (path / "adapter_model.bin").write_bytes(b"\x80\x04not really a pickle")
    rejects(model, base, path, "pickle weights")


def test_corrupt_safetensors(model, base, good, tmp_path):
    path = copy(good, tmp_path)
    (path / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00garbage")
    rejects(model, base, path, "corrupt safetensors")


def test_path_outside_roots(model, base, good, tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    rejects(model, base, good, "outside the allowed adapter_roots", roots=[root])


def test_dotdot_escape_from_roots(model, base, good, tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    copy(good, tmp_path, "outside")
    rejects(model, base, root / ".." / "outside", "outside the allowed", roots=[root])


def test_symlink_escape_from_roots(model, base, good, tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    (root / "link").symlink_to(good, target_is_directory=True)
    rejects(model, base, root / "link", "outside the allowed", roots=[root])


def test_inside_roots_is_accepted(model, base, good, tmp_path):
    root = tmp_path / "root"
    path = copy(good, root.parent, "root")
    assert manager(model, base, [root]).add_lora(LoRARequest("ok", 1, str(path)))


def test_rank_above_max(model, base, tmp_path):
    path = build_adapter(base, tmp_path / "big", rank=32)
    rejects(model, base, path, "rank 32 exceeds max_lora_rank=16")


def test_unknown_target_modules(model, base, good, tmp_path):
    path = copy(good, tmp_path)
    edit_config(path, target_modules=["q_proj", "lm_head"])
    rejects(model, base, path, "unknown target modules")


def test_dora_rejected(model, base, good, tmp_path):
    path = copy(good, tmp_path)
    edit_config(path, use_dora=True)
    rejects(model, base, path, "DoRA")


def test_modules_to_save_rejected(model, base, good, tmp_path):
    path = copy(good, tmp_path)
    edit_config(path, modules_to_save=["lm_head"])
    rejects(model, base, path, "modules_to_save")


def test_non_lora_peft_type(model, base, good, tmp_path):
    path = copy(good, tmp_path)
    edit_config(path, peft_type="IA3")
    rejects(model, base, path, "PEFT type 'IA3' is not supported")


@pytest.mark.parametrize(
    "changes, what",
    [
        ({"future_feature": {"on": True}}, "config field future_feature="),
        ({"lora_bias": True}, "lora_bias"),
        ({"target_modules": ["q_proj", "v_proj"]}, "weights for layer 0 down_proj, which the"),
        ({"layers_to_transform": [1]}, "weights for layer 0 down_proj, which the"),
        ({"lora_alpha": "16"}, "lora_alpha='16' must be a finite number"),
    ],
    ids=["unknown_field", "lora_bias", "untargeted_module", "untransformed_layer", "alpha"],
)
def test_a_config_field_is_never_silently_ignored(model, base, good, tmp_path, changes, what):
    """PEFT would run these otherwise (or not at all): refused, not run our way."""
    path = copy(good, tmp_path)
    edit_config(path, **changes)
    rejects(model, base, path, what)


def test_a_reload_with_another_config_is_refused(model, base, good, tmp_path):
    path = copy(good, tmp_path)
    m = manager(model, base, max_cpu_loras=2)
    m.add_lora(LoRARequest("sql", 1, str(path)))
    loaded = m.identity(1)
    m.add_lora(LoRARequest("b", 2, str(good)))
    m.add_lora(LoRARequest("c", 3, str(copy(good, tmp_path, "c"))))  # 1 leaves the CPU cache
    edit_config(path, lora_alpha=1600)
    errors = m.activate([LoRARequest("sql", 1, str(path))])
    said = str(errors[1, str(path)])
    assert "adapter_config.json changed since adapter id 1 was loaded" in said
    assert "lora_alpha 16.0 -> 1600.0" in said and m.identity(1) == loaded


@pytest.mark.parametrize(
    "layer, a_columns, what",
    [
        (0, 65, "do not fit the base model"),  # A's columns are not the hidden size 64
        (9, 64, "names layer 9"),  # the tiny model has two layers
    ],
    ids=["shapes_that_do_not_fit", "layer_beyond_the_model"],
)
def test_weights_that_do_not_match_the_model(model, base, good, tmp_path, layer, a_columns, what):
    path = copy(good, tmp_path)
    key = f"base_model.model.model.layers.{layer}.self_attn.q_proj"
    save_file(
        {
            f"{key}.lora_A.weight": torch.zeros(8, a_columns),
            f"{key}.lora_B.weight": torch.zeros(64, 8),
        },
        str(path / "adapter_model.safetensors"),
    )
    rejects(model, base, path, what)


@pytest.mark.parametrize(
    "key, value, what",
    [
        ("layers.1.mlp.down_proj.lora_B", float("nan"), "1 NaN"),
        ("layers.0.self_attn.q_proj.lora_A", float("inf"), r"1 \+Inf"),
        ("layers.1.self_attn.v_proj.lora_B", float("-inf"), "1 -Inf"),
    ],
)
def test_non_finite_weights(model, base, good, tmp_path, key, value, what):
    path = copy(good, tmp_path)
    set_weight(path, key, value)
    layer, name = key.split(".")[1], key.split(".")[-2]
    kind = key.split(".")[-1]
    rejects(
        model, base, path, f"layer {layer} {name} {kind} holds {what}; the weights must be finite"
    )


def test_same_id_different_path(model, base, good, tmp_path):
    other = copy(good, tmp_path)
    m = manager(model, base)
    m.add_lora(LoRARequest("sql", 1, str(good)))
    with pytest.raises(AdapterError, match="already registered with path"):
        m.add_lora(LoRARequest("sql", 1, str(other)))


def test_same_id_weights_changed_on_disk(model, base, good, tmp_path):
    path = copy(good, tmp_path)
    m = manager(model, base, max_cpu_loras=2)
    m.add_lora(LoRARequest("sql", 1, str(path)))
    m.add_lora(LoRARequest("b", 2, str(good)))
    m.add_lora(LoRARequest("c", 3, str(copy(good, tmp_path, "c"))))  # 1 leaves the CPU cache
    assert 1 not in m.list_loras()
    build_adapter(base, path, rank=8, targets=ALL_TARGETS, alpha=16, seed=5)
    errors = m.activate([LoRARequest("sql", 1, str(path))])
    assert "weights changed" in str(errors[1, str(path)])


@pytest.fixture(scope="module")
def six(base, tmp_path_factory):
    root = tmp_path_factory.mktemp("six")
    return [
        LoRARequest(f"l{i}", i, str(build_adapter(base, root / f"l{i}", seed=i)))
        for i in range(1, 7)
    ]


def test_slots_evict_least_recently_used(model, base, six):
    m = manager(model, base, max_cpu_loras=3)
    assert not m.activate(six[:2])
    assert m.slots == [1, 2]
    assert not m.activate([six[0]])  # 1 used again: 2 is now the oldest
    assert not m.activate([six[2]])
    assert m.slots == [1, 3]
    assert m.list_loras() == {1, 2, 3}
    assert not m.activate([six[3]])  # CPU LRU drops 2, the oldest not in a slot
    assert m.list_loras() == {1, 3, 4} and m.slots == [4, 3]


def test_no_slot_for_more_adapters_than_slots_in_one_step(model, base, six):
    errors = manager(model, base).activate(six[:3])
    key = (3, six[2].lora_path)
    assert list(errors) == [key] and "no free device slot" in str(errors[key])


def test_one_id_with_two_paths_in_one_step_refuses_the_second(model, base, good, tmp_path):
    """LoRARequests compare by id: the step must still see both paths."""
    first = LoRARequest("sql", 1, str(good))
    second = LoRARequest("sql-copy", 1, str(copy(good, tmp_path)))
    m = manager(model, base)
    errors = m.activate([first, second])
    assert list(errors) == [(1, second.lora_path)]
    assert "already registered with path" in str(errors[1, second.lora_path])
    assert m.slots == [1, None] and m.registry[1][0] == str(good.resolve())


def test_pinned_adapter_keeps_its_slot(model, base, six):
    m = manager(model, base, max_cpu_loras=2)
    m.add_lora(six[0])
    m.pin_lora(1)
    assert not m.activate([six[0]])
    for request in six[1:5]:
        assert not m.activate([request])
    assert 1 in m.slots and 1 in m.list_loras()
    m.add_lora(six[1])
    m.pin_lora(2)
    with pytest.raises(ValueError, match="more than max_cpu_loras=2"):
        m.pin_lora(6)
    assert not m.activate(six[2:4])  # a step of max_loras adapters still gets its slots
    assert m.list_loras() >= {1, 2}


def test_remove_lora_frees_slot_and_identity(model, base, six, good):
    m = manager(model, base)
    m.activate([six[0]])
    assert m.remove_lora(1) and m.slots == [None, None] and m.list_loras() == set()
    assert not m.remove_lora(1)
    m.add_lora(LoRARequest("reused", 1, str(good)))  # the id may now name another adapter


def test_every_rejection_fails_only_its_own_requests(base, good, tmp_path):
    """One engine, one stream of requests: each kind of bad adapter ends its own
    requests with an error naming it and the reason; the others match PEFT."""
    root = tmp_path / "root"
    root.mkdir()
    inside = LoRARequest("good", 1, str(copy(good, root, "good")))
    outside = copy(good, tmp_path, "outside")
    (root / "link").symlink_to(outside, target_is_directory=True)
    bad = {  # path -> the reason its error must give
        root / "nope": "does not exist",
        root / ".." / "outside": "outside the allowed adapter_roots",
        root / "link": "outside the allowed adapter_roots",
        build_adapter(base, root / "r32", rank=32): "rank 32 exceeds max_lora_rank=16",
    }
    for name, reason, damage in DAMAGES:
        path = copy(good, root, name)
        damage(path)
        bad[path] = reason
    failing = [
        (LoRARequest(f"bad-{i}", i + 2, str(p)), why) for i, (p, why) in enumerate(bad.items())
    ]
    same_id = LoRARequest("same-id", 1, str(copy(good, root, "same-id")))
    failing.append((same_id, "adapter id 1 is already registered with path"))
    jobs = [([5, 6, 7], 6, inside, None), ([8, 9], 6, None, None)]
    for request, why in failing:
        jobs += [([10, 11], 4, request, why), ([12], 6, inside, None), ([13, 14], 5, None, None)]

    args = dict(max_loras=2, max_lora_rank=16, adapter_roots=[str(root)])
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(base), enable_lora=True, **args))
    finals = {}
    for i, (prompt, max_tokens, request, _) in enumerate(jobs):  # one arrival a step
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, params, lora_request=request)
        finals.update((out.request_id, out) for out in engine.step() if out.finished)
    while engine.has_unfinished_requests():
        finals.update((out.request_id, out) for out in engine.step() if out.finished)

    assert len(finals) == len(jobs)
    for i, (prompt, max_tokens, request, why) in enumerate(jobs):
        out = finals[f"r{i}"]
        if why is None:
            want = peft_greedy(base, request and request.lora_path, prompt, max_tokens)
            assert out.error is None and out.outputs[0].token_ids == want
        else:
            assert out.outputs[0].finish_reason == "error" and out.lora_request is request
            assert f"'{request.lora_name}'" in out.error and why in out.error, out.error


WEIGHTS = "adapter_model.safetensors"


def _to_pickle(path):
    os.remove(path / WEIGHTS)
    (path / "adapter_model.bin").write_bytes(b"\x80\x04not really a pickle")


def _wrong_shapes(path):
    key = "base_model.model.model.layers.0.self_attn.q_proj"
    a, b = torch.zeros(8, 65), torch.zeros(64, 8)
    save_file({f"{key}.lora_A.weight": a, f"{key}.lora_B.weight": b}, str(path / WEIGHTS))


# name, the reason its error must give, how a copy of a good adapter is damaged
DAMAGES = [
    ("nofile", "missing adapter_model.safetensors", lambda p: os.remove(p / WEIGHTS)),
    ("pickle", "pickle weights", _to_pickle),
    ("corrupt", "corrupt safetensors", lambda p: (p / WEIGHTS).write_bytes(b"\x10\0\0\0!")),
    ("lmhead", "unknown target modules", lambda p: edit_config(p, target_modules=["lm_head"])),
    ("dora", "DoRA", lambda p: edit_config(p, use_dora=True)),
    ("save", "modules_to_save", lambda p: edit_config(p, modules_to_save=["lm_head"])),
    ("ia3", "PEFT type 'IA3'", lambda p: edit_config(p, peft_type="IA3")),
    ("shape", "do not fit the base model", _wrong_shapes),
]
