"""Adapter administration over HTTP (vLLM's bodies): role admin, off by default,
registering as ``lorapool adapters add`` does (name rule, roots, sha256)."""

from __future__ import annotations

import hashlib
import json

import httpx
import pytest
from gateway_procs import serve, stop

from lorapool.lifecycle.keys import Keys
from lorapool.producer.api_keys import ApiKeys

pytestmark = pytest.mark.integration


def fake_adapter(path, weights: bytes):
    path.mkdir(parents=True)
    (path / "adapter_model.safetensors").write_bytes(weights)
    (path / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8}))
    return path


@pytest.fixture(scope="module")
def admin(redis_url, prefix, conn, tmp_path_factory):
    """(url of a gateway with adapter admin on, inside root; admin key; submit key)"""
    store = ApiKeys(conn, Keys(prefix))
    admin_key, submit_key = store.add("ops", "admin")[1], store.add("acme", "submit")[1]
    root = tmp_path_factory.mktemp("admin-adapters")
    extra = ("--enable-adapter-admin", "--adapter-root", str(root))
    url, proc = serve(redis_url, prefix, root, *extra, auth=True)
    yield url, root, admin_key, submit_key
    stop(proc)


def post(url, path, body, key):
    return httpx.post(f"{url}{path}", json=body, headers={"Authorization": f"Bearer {key}"})


def test_load_list_unload(admin, producer):
    url, root, key, _ = admin
    path = fake_adapter(root / "new-lora", b"weights v1")
    loaded = post(
        url, "/v1/load_lora_adapter", {"lora_name": "new-lora", "lora_path": str(path)}, key
    )
    assert loaded.status_code == 200, loaded.text
    record = producer.registry.get("new-lora")
    assert record.sha256 == hashlib.sha256(b"weights v1").hexdigest()
    assert loaded.json()["adapter"] == record.to_dict()
    models = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"}).json()
    assert "new-lora" in [m["id"] for m in models["data"]]
    gone = post(url, "/v1/unload_lora_adapter", {"lora_name": "new-lora"}, key)
    assert gone.status_code == 200 and producer.registry.get("new-lora") is None
    again = post(url, "/v1/unload_lora_adapter", {"lora_name": "new-lora"}, key)
    assert again.status_code == 404


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"lora_name": "bad name", "lora_path": "{root}/x"}, "lora_name"),
        ({"lora_name": "x", "lora_path": "/etc"}, "lora_path"),
        ({"lora_name": "x", "lora_path": "{root}/missing"}, "lora_path"),
        ({"lora_name": 5, "lora_path": "{root}/x"}, "lora_name"),
        ({"lora_name": "x"}, "lora_path"),
        ({"lora_name": "x", "lora_path": "{root}/x", "extra": 1}, "extra"),
        ({"lora_name": True, "lora_path": "{root}/x"}, "lora_name"),
        ({"lora_name": "", "lora_path": "{root}/x"}, "lora_name"),
        ({"lora_name": "x", "lora_path": ["{root}/x"]}, "lora_path"),
        ({"lora_name": "x", "lora_path": "{root}/x\x00y"}, "lora_path"),
        ({"lora_name": "x\x00y", "lora_path": "{root}/x"}, "lora_name"),
        ({"lora_name": "x", "lora_path": 2**70}, "lora_path"),
        ([{"lora_name": "x"}], None),
    ],
)
def test_refusals_name_the_field(admin, body, param):
    url, root, key, _ = admin
    if isinstance(body, dict):
        body = {k: v.replace("{root}", str(root)) if isinstance(v, str) else v
                for k, v in body.items()}  # fmt: skip
    response = post(url, "/v1/load_lora_adapter", body, key)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


@pytest.mark.parametrize(
    ("path", "raw", "param", "words"),
    [
        ("/v1/unload_lora_adapter", b'{"lora_name": "x", "lora_path": "/x"}', "lora_path",
         "unknown parameter 'lora_path'"),
        ("/v1/unload_lora_adapter", b'{"lora_name": 5}', "lora_name",
         "lora_name must be a non-empty string, got 5"),
        ("/v1/unload_lora_adapter", b"{}", "lora_name", "lora_name is required"),
        ("/v1/load_lora_adapter", b'{"lora_name": "\xff", "lora_path": "/x"}', None,
         "not valid JSON"),
        ("/v1/lora_resolver", b'{"enabled": 1}', "enabled", "enabled must be true or false, got 1"),
        ("/v1/lora_resolver", b'{"enabled": "false"}', "enabled", "got 'false'"),
        ("/v1/lora_resolver", b'{"enabled": true, "roots": []}', "roots", "unknown parameter"),
        ("/v1/lora_resolver", b"null", None, "must be a JSON object, got None"),
    ],
)  # fmt: skip
def test_admin_bodies_refused_naming_the_field(admin, path, raw, param, words):
    """Wrong types, an int for a bool, unknown fields, bytes that are not UTF-8: each a
    400 in OpenAI's shape naming the field (vLLM's bodies; the resolver's toggle)."""
    url, _, key, _ = admin
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    response = httpx.post(f"{url}{path}", content=raw, headers=headers)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_only_admins(admin):
    url, root, _, submit_key = admin
    body = {"lora_name": "x", "lora_path": str(root)}
    assert post(url, "/v1/load_lora_adapter", body, submit_key).status_code == 403
    assert post(url, "/v1/load_lora_adapter", body, None).status_code == 401


def test_off_unless_enabled(gateway):
    response = httpx.post(f"{gateway}/v1/load_lora_adapter", json={"lora_name": "x"})
    assert response.status_code == 404


def test_a_name_taken_by_other_weights_is_refused_on_lora_name(admin):
    url, root, key, _ = admin
    first, second = fake_adapter(root / "one", b"one"), fake_adapter(root / "two", b"two")
    body = {"lora_name": "taken", "lora_path": str(first)}
    assert post(url, "/v1/load_lora_adapter", body, key).status_code == 200
    response = post(url, "/v1/load_lora_adapter", {**body, "lora_path": str(second)}, key)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "lora_name" and "already registered" in error["message"]


@pytest.mark.parametrize("adapter_id", [0, True, 2**31, "3", 1.0, -1])
def test_a_registry_refuses_an_adapter_id_out_of_bounds(producer, tmp_path, adapter_id):
    """The id a LoRARequest may carry (``bounds.AdapterId``), checked before Redis."""
    path = fake_adapter(tmp_path / "an-adapter", b"weights")
    with pytest.raises(ValueError, match=r"adapter id must be an integer in \[1, 2147483647\]"):
        producer.registry.add("bad-id", path, adapter_id)
    assert producer.registry.get("bad-id") is None
