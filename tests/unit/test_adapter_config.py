"""An adapter's config identity (``lorapool.adapter_config``): the fields that change the
math are hashed, training and bookkeeping fields are not, and a field the loader does
not know is refused when set. PEFT's own ``LoraConfig`` is the oracle for what a saved
config holds."""

import hashlib
import tempfile
from pathlib import Path

import pytest

from lorapool.adapter_config import (
    AdapterIdentity,
    changes,
    config_sha256,
    identity_of,
    parse_config,
    refusal,
)
from lorapool.records.adapter import AdapterRecord, encode_adapter_record

BASE = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}
WEIGHTS = hashlib.sha256(b"weights").hexdigest()


def peft_saved(**kw) -> dict:
    """A config as PEFT writes ``adapter_config.json`` (every field of its LoraConfig)."""
    peft = pytest.importorskip("peft")
    with tempfile.TemporaryDirectory() as folder:
        peft.LoraConfig(**kw).save_pretrained(folder)
        return parse_config((Path(folder) / "adapter_config.json").read_bytes())


@pytest.mark.parametrize(
    "edit",
    [
        {"lora_alpha": 1600},
        {"r": 4},
        {"use_rslora": True},
        {"target_modules": ["q_proj"]},
        {"layers_to_transform": [0]},
        {"fan_in_fan_out": True},
        {"use_dora": True},
    ],
)
def test_a_field_that_changes_the_math_changes_the_hashes(edit):
    before, after = identity_of(BASE, WEIGHTS), identity_of({**BASE, **edit}, WEIGHTS)
    assert after.config_sha256 != before.config_sha256
    assert after.digest != before.digest and after.sha256 == before.sha256


@pytest.mark.parametrize(
    "edit",
    [
        {"lora_dropout": 0.3, "task_type": "SEQ_CLS", "inference_mode": True},
        {"lora_alpha": 16.0},  # the same number
        {"target_modules": ["v_proj", "q_proj", "q_proj"]},  # the same set
        {"base_model_name_or_path": "/elsewhere", "peft_version": "9.9"},
        {"use_dora": False, "modules_to_save": None, "rank_pattern": {}},  # defaults spelled
    ],
)
def test_training_and_bookkeeping_fields_do_not(edit):
    assert config_sha256({**BASE, **edit}) == config_sha256(BASE)


def test_defaults_are_peft_s():
    config = peft_saved(r=8, lora_alpha=8, target_modules=["q_proj"])
    assert config_sha256({"target_modules": ["q_proj"], "peft_type": "LORA"}) == (
        config_sha256(config)
    )


def test_the_digest_is_over_both_files():
    one = identity_of(BASE, WEIGHTS)
    other = identity_of(BASE, hashlib.sha256(b"other").hexdigest())
    assert one.config_sha256 == other.config_sha256 and one.digest != other.digest
    assert (one.rank, one.alpha, one.target_modules) == (8, 16.0, ("q_proj", "v_proj"))


def test_a_config_peft_saves_is_not_refused():
    assert refusal(peft_saved(r=4, target_modules=["q_proj"], task_type="CAUSAL_LM")) is None


@pytest.mark.parametrize(
    "edit, said",
    [
        ({"future_feature": {"on": True}}, "config field future_feature="),
        ({"lora_bias": True}, "lora_bias (lora_bias=True) is not supported"),
        ({"alora_invocation_tokens": [5]}, "aLoRA"),
        ({"exclude_modules": ["q_proj"]}, "exclude_modules"),
        ({"bias": "all"}, "bias='all' is not supported"),
        ({"peft_type": "IA3"}, "PEFT type 'IA3' is not supported"),
    ],
)
def test_a_field_the_loader_does_not_run_is_refused(edit, said):
    assert said in refusal({**BASE, **edit})


def test_an_unknown_field_left_unset_is_not_refused():
    assert refusal({**BASE, "future_feature": None, "other": False}) is None


@pytest.mark.parametrize("raw", [b"{", b"[1]", b"\xff"])
def test_a_config_that_is_no_json_object_is_named(raw):
    with pytest.raises(ValueError, match="adapter_config.json is not"):
        parse_config(raw)


def test_changes_name_the_field_and_the_hashes():
    registered = identity_of(BASE, WEIGHTS)
    edited = identity_of({**BASE, "lora_alpha": 1600}, WEIGHTS)
    (said,) = changes(registered, edited)
    assert said.startswith("adapter_config.json changed since registration (lora_alpha 16.0 -> ")
    assert registered.config_sha256[:12] in said and edited.config_sha256[:12] in said
    assert changes(registered, registered) == []
    swapped = identity_of(BASE, hashlib.sha256(b"swapped").hexdigest())
    (said,) = changes(registered, swapped)
    assert said.startswith("weights changed since registration (sha256 ")


def test_a_record_without_hashes_is_checked_on_the_fields_it_has():
    old = AdapterRecord("a", 1, "/a", WEIGHTS, 8, 16.0, ("q_proj", "v_proj"))
    assert changes(old, identity_of(BASE, WEIGHTS)) == []
    (said,) = changes(old, identity_of({**BASE, "lora_alpha": 1600}, WEIGHTS))
    assert "lora_alpha 16.0 -> 1600.0" in said and "config sha256" not in said
    # one the record cannot see (it has no config hash): the audit row will show it
    assert changes(old, identity_of({**BASE, "use_rslora": True}, WEIGHTS)) == []


def test_a_record_as_loaded_carries_the_loaded_identity():
    old = AdapterRecord("a", 1, "/a", WEIGHTS, 0, 0.0, ())
    loaded = identity_of(BASE, WEIGHTS)
    record = old.as_loaded(loaded)
    assert (record.rank, record.alpha, record.target_modules) == (8, 16.0, ("q_proj", "v_proj"))
    assert (record.config_sha256, record.digest) == (loaded.config_sha256, loaded.digest)
    assert b'"digest":"%s"' % loaded.digest.encode() in encode_adapter_record(record)
    assert b"digest" not in encode_adapter_record(old)  # old records keep their bytes
    assert isinstance(loaded, AdapterIdentity)
