"""API keys, roles and tenants against a gateway with auth on (no worker: jobs stay
queued, which is all these checks need). Every /v1 endpoint is tried with no key, a
malformed, unknown and revoked key (401), a key of the wrong role (403) and another
tenant's job id (404): the answer reveals nothing of the job."""

from __future__ import annotations

import httpx
import orjson
import pytest
from gateway_procs import serve, stop

from lorapool.gateway.auth import OPEN, Principal
from lorapool.lifecycle.keys import Keys
from lorapool.producer.api_keys import ApiKeys
from lorapool.records.job import decode_job

pytestmark = pytest.mark.integration
JOB = {"model": "ad-a", "prompt": "hello", "max_tokens": 2}
CHAT = {"model": "ad-a", "messages": [{"role": "user", "content": "x"}]}
ENDPOINTS = [
    ("GET", "/v1/models", None),
    ("POST", "/v1/completions", JOB),
    ("POST", "/v1/chat/completions", CHAT),
    ("POST", "/v1/jobs", JOB),
    ("GET", "/v1/jobs/{id}", None),
    ("GET", "/v1/jobs/{id}/events", None),
    ("DELETE", "/v1/jobs/{id}", None),
]  # fmt: skip


@pytest.fixture(scope="module")
def api_keys(conn, prefix, tmp_path_factory, producer):
    conn.set(f"{prefix}:model", b'{"name": "base", "sha256": "00"}')
    root = tmp_path_factory.mktemp("fake-adapters")
    for i, name in enumerate(("ad-a", "ad-b")):
        info = {"path": str(root / name), "sha256": f"{i}" * 64, "rank": 8, "alpha": 8.0}
        producer.registry.add(name, root / name, info={**info, "target_modules": []})
    store = ApiKeys(conn, Keys(prefix))
    made = {
        "acme": store.add("acme", "submit"),
        "globex": store.add("globex", "submit", ["ad-a"]),
        "auditor": store.add("acme", "audit"),
        "revoked": store.add("acme", "submit"),
        "slow": store.add("slow", "submit", rpm=2),
        "thrifty": store.add("thrifty", "submit", tpm=5),
        "heavy": store.add("heavy", "submit", weight=4.0),
        "door": store.add("door", "submit", rpm=2, tpm=1000),
    }
    store.revoke(made["revoked"][0].id)
    return {name: key for name, (_, key) in made.items()} | {
        f"{name}-id": record.id for name, (record, _) in made.items()
    }


@pytest.fixture(scope="module")
def secure(redis_url, prefix, api_keys, tmp_path_factory):
    url, proc = serve(redis_url, prefix, tmp_path_factory.mktemp("gw"), auth=True)
    yield url
    stop(proc)


def call(url, method, path, body=None, key=None, job_id="x"):
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    return httpx.request(
        method, url + path.replace("{id}", job_id), json=body, headers=headers, timeout=30
    )


def acme_job(secure, api_keys) -> str:
    response = call(secure, "POST", "/v1/jobs", JOB, api_keys["acme"])
    assert response.status_code == 202, response.text
    return response.json()["id"]


@pytest.mark.parametrize(("method", "path", "body"), ENDPOINTS)
@pytest.mark.parametrize("key", [None, "nope", "lp_0123456789abcdef_" + "x" * 43, "revoked"])
def test_no_valid_key_is_401(secure, api_keys, method, path, body, key):
    job_id = acme_job(secure, api_keys)
    response = call(secure, method, path, body, api_keys.get(key, key), job_id)
    assert response.status_code == 401, response.text
    assert response.headers["www-authenticate"] == "Bearer"
    assert job_id not in response.text and "hello" not in response.text


@pytest.mark.parametrize(("method", "path", "body"), ENDPOINTS[1:])
def test_a_key_without_the_role_is_403(secure, api_keys, method, path, body):
    job_id = acme_job(secure, api_keys)
    response = call(secure, method, path, body, api_keys["auditor"], job_id)
    assert response.status_code == 403, response.text
    assert job_id not in response.text


@pytest.mark.parametrize(("method", "path", "body"), ENDPOINTS[4:])
def test_another_tenants_job_is_not_found(secure, api_keys, producer, method, path, body):
    job_id = acme_job(secure, api_keys)
    response = call(secure, method, path, body, api_keys["globex"], job_id)
    assert response.status_code == 404, response.text
    assert response.json()["error"] == {
        "message": "no such job", "type": "not_found_error", "param": "id",
        "code": "job_not_found",
    }  # fmt: skip
    assert (
        call(secure, "GET", "/v1/jobs/{id}", None, api_keys["acme"], job_id).json()["status"]
        == "queued"
    )
    assert not producer.redis.exists(producer.keys.abort(f"acme~{job_id}"))


def test_the_job_carries_tenant_and_key_id(secure, api_keys, conn, prefix):
    job_id = acme_job(secure, api_keys)
    entries = conn.xrange(f"{prefix}:requests")
    jobs = [decode_job(fields[b"data"]) for _, fields in entries]
    [job] = [j for j in jobs if j.request_id == f"acme~{job_id}"]
    assert job.metadata == {"tenant": "acme", "key_id": api_keys["acme-id"]}


def test_the_job_carries_its_keys_fair_share_weight(secure, api_keys, conn, prefix):
    """A key's weight (``keys add --weight``) rides in its jobs' metadata, where the
    worker reads the tenant's fair share of the engine (issue 51 row 4); a key without
    one adds nothing (the test above)."""
    job_id = call(secure, "POST", "/v1/jobs", {**JOB, "user": "u"}, api_keys["heavy"]).json()["id"]
    entries = conn.xrange(f"{prefix}:requests")
    [job] = [
        j for j in (decode_job(f[b"data"]) for _, f in entries) if j.request_id == f"heavy~{job_id}"
    ]
    assert job.metadata == {
        "user": "u", "tenant": "heavy", "key_id": api_keys["heavy-id"], "weight": 4.0
    }  # fmt: skip
    with pytest.raises(ValueError, match="weight"):
        ApiKeys(conn, Keys(prefix)).add("bad", "submit", weight=0)


def test_a_client_cannot_give_its_job_a_weight():
    caller = Principal("acme", "submit", "k1")
    given = {"weight": 1000, "note": "x"}
    assert caller.job_metadata(given) == {"note": "x", "tenant": "acme", "key_id": "k1"}
    assert OPEN.job_metadata(given) == given  # no tenants: nothing to share


def test_the_same_client_id_in_two_tenants_is_two_jobs(secure, api_keys):
    body = {**JOB, "request_id": "order-1"}
    first = call(secure, "POST", "/v1/jobs", body, api_keys["acme"])
    second = call(secure, "POST", "/v1/jobs", body, api_keys["globex"])
    assert first.json()["id"] == second.json()["id"] == "order-1"
    assert first.json()["status"] == second.json()["status"] == "queued"
    assert first.headers["location"] == "/v1/jobs/order-1"


def test_a_tenant_sees_and_uses_only_its_adapters(secure, api_keys):
    models = call(secure, "GET", "/v1/models", key=api_keys["globex"]).json()["data"]
    assert [m["id"] for m in models] == ["base", "ad-a"]
    every = call(secure, "GET", "/v1/models", key=api_keys["auditor"]).json()["data"]
    assert [m["id"] for m in every] == ["base", "ad-a", "ad-b"]
    refused = call(secure, "POST", "/v1/jobs", {**JOB, "model": "ad-b"}, api_keys["globex"])
    assert refused.status_code == 404 and refused.json()["error"]["code"] == "model_not_found"


def test_operations_need_no_key(secure):
    assert httpx.get(f"{secure}/healthz").status_code == 200
    ready = httpx.get(f"{secure}/readyz")  # no worker: ready all the same, and says so
    assert ready.status_code == 200 and ready.json()["workers"] == 0


def test_keys_cli_add_list_revoke(secure, redis_url, prefix):
    from click.testing import CliRunner

    from lorapool.cli.keys import keys

    where = ["--redis-url", redis_url, "--prefix", prefix]
    added = CliRunner().invoke(keys, ["add", "initech", "--role", "submit", *where])
    assert added.exit_code == 0, added.output
    key = added.output.strip().splitlines()[-1]
    key_id = key.split("_")[1]
    listed = CliRunner().invoke(keys, ["list", *where])
    assert key_id in listed.output and key not in listed.output
    assert call(secure, "GET", "/v1/models", key=key).status_code == 200
    assert CliRunner().invoke(keys, ["revoke", key_id, *where]).exit_code == 0
    assert call(secure, "GET", "/v1/models", key=key).status_code == 401


def test_a_tenant_over_its_rate_gets_429_and_others_do_not(secure, api_keys):
    for _ in range(2):
        assert call(secure, "POST", "/v1/jobs", JOB, api_keys["slow"]).status_code == 202
    refused = call(secure, "POST", "/v1/jobs", JOB, api_keys["slow"])
    assert refused.status_code == 429, refused.text
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert 1 <= int(refused.headers["retry-after"]) <= 30  # 2 a minute: one every 30 s
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    assert call(secure, "POST", "/v1/completions", JOB, api_keys["slow"]).status_code == 429
    assert call(secure, "POST", "/v1/jobs", JOB, api_keys["acme"]).status_code == 202


SUBMITS = ("/v1/chat/completions", "/v1/completions", "/v1/jobs", "/v1/responses")


def test_a_key_with_no_room_in_its_minute_gets_429_before_its_body_is_parsed(secure, api_keys):
    """Issue 51, limits before work: a submit route counts what its body asks for once
    it has read it, and looks at the door whether the key's minute has room for one
    request (any submit's least). A key without room gets its 429 for a body it never
    parsed (here not even JSON: a 400 once parsed), and the look takes nothing: twelve
    refused bodies leave both of its two requests a minute to real submits."""
    door, broken = api_keys["door"], b'{"model": "base", "prompt": '
    headers = {"Authorization": f"Bearer {door}", "Content-Type": "application/json"}

    def post(path: str) -> httpx.Response:
        return httpx.post(secure + path, content=broken, headers=headers, timeout=30)

    for path in SUBMITS * 3:
        refused = post(path)
        assert refused.status_code == 400, (path, refused.text)
    for _ in range(2):
        assert call(secure, "POST", "/v1/jobs", JOB, door).status_code == 202
    for path in SUBMITS:
        refused = post(path)
        assert refused.status_code == 429, (path, refused.text)
        assert refused.json()["error"]["code"] == "rate_limit_exceeded"
        assert 1 <= int(refused.headers["retry-after"]) <= 30
        assert refused.headers["x-ratelimit-remaining-requests"] == "0"
        assert refused.headers["x-ratelimit-limit-tokens"] == "1000"


def test_a_token_rate_counts_what_a_request_may_generate(secure, api_keys):
    thrifty = api_keys["thrifty"]
    assert call(secure, "POST", "/v1/jobs", {**JOB, "max_tokens": 4}, thrifty).status_code == 202
    over = call(secure, "POST", "/v1/jobs", {**JOB, "max_tokens": 2}, thrifty)
    assert over.status_code == 429
    assert call(secure, "POST", "/v1/jobs", {**JOB, "max_tokens": 1}, thrifty).status_code == 202
    unbounded = call(secure, "POST", "/v1/chat/completions", CHAT, thrifty)
    assert unbounded.status_code == 400 and unbounded.json()["error"]["param"] == "max_tokens"


def test_models_retrieve_is_scoped_as_the_list(secure, api_keys):
    card = call(secure, "GET", "/v1/models/ad-a", key=api_keys["globex"])
    assert card.status_code == 200 and card.json()["root"] == "ad-a"  # its name, no path
    hidden = call(secure, "GET", "/v1/models/ad-b", key=api_keys["globex"])
    assert hidden.status_code == 404 and hidden.json()["error"]["code"] == "model_not_found"
    assert call(secure, "GET", "/v1/models/ad-b", key=api_keys["auditor"]).status_code == 200
    assert call(secure, "GET", "/v1/models/ad-a").status_code == 401


def test_a_stored_response_is_its_tenants_alone(secure, api_keys, conn, prefix):
    """A response stored for acme (as the gateway stores one) is acme's: another tenant
    gets 404 for it, and cannot continue it."""
    response = {"id": "resp_abc", "object": "response", "output": [], "status": "queued"}
    item = {"type": "message", "id": "msg_1", "role": "user", "status": "completed",
            "content": [{"type": "input_text", "text": "x"}]}  # fmt: skip
    asked = {"model": "ad-a", "input": "x", "background": True}  # as the gateway keeps it
    record = {"response": response, "conversation": [{"role": "user", "content": "x"}],
              "input_items": [item],
              "background": {"jobs": ["acme~queued"], "request": asked, "previous": 0}}  # fmt: skip
    conn.set(Keys(prefix).response("acme~resp_abc"), orjson.dumps(record), ex=60)
    conn.hset(Keys(prefix).job("acme~queued"), "submitted", "1")  # its job, still queued
    conn.expire(Keys(prefix).job("acme~queued"), 60)
    path = "/v1/responses/resp_abc"
    assert call(secure, "GET", path, key=api_keys["acme"]).json() == response
    assert call(secure, "GET", path, key=api_keys["globex"]).status_code == 404
    assert call(secure, "DELETE", path, key=api_keys["globex"]).status_code == 404
    assert call(secure, "GET", path).status_code == 401
    assert call(secure, "GET", path, key=api_keys["auditor"]).status_code == 403
    items = call(secure, "GET", path + "/input_items", key=api_keys["acme"]).json()
    assert items["data"] == [item]
    for other in ("/input_items", "/cancel"):
        method = "POST" if other == "/cancel" else "GET"
        assert call(secure, method, path + other, key=api_keys["globex"]).status_code == 404
    go_on = {"model": "ad-a", "input": "y", "previous_response_id": "resp_abc"}
    refused = call(secure, "POST", "/v1/responses", go_on, api_keys["globex"])
    assert refused.status_code == 404 and refused.json()["error"]["param"] == "previous_response_id"
    cancelled = call(secure, "POST", path + "/cancel", key=api_keys["acme"]).json()
    assert cancelled == {**response, "status": "cancelled"}
    assert call(secure, "DELETE", path, key=api_keys["acme"]).json()["deleted"] is True
    assert not conn.exists(Keys(prefix).response("acme~resp_abc"))


READS = [
    ("GET", "/v1/models"),
    ("GET", "/v1/models/ad-a"),
    ("GET", "/v1/jobs/{id}"),
    ("DELETE", "/v1/jobs/{id}"),
    ("GET", "/v1/responses/resp_none"),
    ("GET", "/v1/files"),
    ("GET", "/v1/batches"),
    ("GET", "/v1/batches/batch_none"),
    ("GET", "/v1/files/file_none"),
    ("POST", "/v1/batches/batch_none/cancel"),
]  # fmt: skip


@pytest.mark.parametrize(("method", "path"), READS)
def test_reads_count_against_the_keys_rpm(secure, conn, prefix, method, path):
    """Every authenticated route counts one request against its key's rpm, before any
    work: the N+1-th call in a minute is a 429 with Retry-After, whatever its answer
    would have been (a 404 included); another tenant's key is not touched."""
    store = ApiKeys(conn, Keys(prefix))
    tenant = f"reader-{abs(hash((method, path))) % 10**8}"
    _, key = store.add(tenant, "submit", rpm=3)
    _, other = store.add(f"{tenant}-other", "submit", rpm=3)
    answers = [call(secure, method, path, key=key) for _ in range(3)]
    assert all(a.status_code != 429 for a in answers), [a.text for a in answers]
    refused = call(secure, method, path, key=key)
    assert refused.status_code == 429, refused.text
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert 1 <= int(refused.headers["retry-after"]) <= 20  # 3 a minute: one every 20 s
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    assert call(secure, method, path, key=other).status_code == answers[0].status_code
    assert call(secure, "POST", "/v1/jobs", JOB, key).status_code == 429  # one budget


def test_health_and_metrics_count_nothing(secure, conn, prefix):
    store = ApiKeys(conn, Keys(prefix))
    _, auditor = store.add("scraper", "audit", rpm=1)
    for _ in range(3):
        assert call(secure, "GET", "/metrics", key=auditor).status_code == 200
        for path in ("/healthz", "/readyz", "/health", "/version"):  # no key, no count
            assert call(secure, "GET", path).status_code == 200
    assert call(secure, "GET", "/v1/models", key=auditor).status_code == 200  # its one
    assert call(secure, "GET", "/v1/models", key=auditor).status_code == 429
