"""Webhook deliveries end to end: jobs with ``on_finish`` run on a real worker, the
``lorapool audit-writer`` process dispatches them into their tenant's lane, RQ workers
(processes, ``--with-scheduler``) send them through the egress module to receivers on
loopback ports of this process (allow-listed: ``--webhook-allow 127.0.0.1/32``).

Deliveries verify with the ``standardwebhooks`` package and the ``openai`` client's
webhook helper; another tenant's secret and a replay past the tolerance do not; a
rotation signs with both secrets; retries keep the webhook-id; a delivery that never
succeeds, or points inward past the allow-list, goes to the dead letter."""

from __future__ import annotations

import time
from datetime import datetime, timedelta

import openai
import orjson
import pytest
import standardwebhooks
import standardwebhooks.webhooks
from gateway_procs import start_audit_writer, stop
from receivers import Receiver

from lorapool import SamplingParams
from lorapool.batch.webhook_secrets import WebhookSecrets
from lorapool.lifecycle.keys import Keys
from lorapool.lifecycle.pool_metrics import PoolCollector
from lorapool.producer import Producer

pytestmark = pytest.mark.usefixtures("worker")


@pytest.fixture
def dispatcher(redis_url, prefix, tmp_path):
    """Start ``lorapool audit-writer`` with webhook options: ``dispatcher(*flags)``."""
    procs = []

    def start(*flags: str):
        db = f"sqlite:///{tmp_path / f'audit-{len(procs)}.sqlite'}"
        procs.append(
            start_audit_writer(redis_url, prefix, db, tmp_path, "--callback-queue", prefix, *flags)
        )
        return procs[-1]

    yield start
    for proc in procs:
        stop(proc)


@pytest.fixture
def secrets(conn, prefix):
    return WebhookSecrets(conn, Keys(prefix))


def _submit(conn, prefix, tenant: str, rid: str, url: str, tokens: int = 3):
    producer = Producer(conn, prefix=prefix)
    params = SamplingParams(max_tokens=tokens, temperature=0)
    return producer.submit(
        f"hook {rid}", params, None, f"{tenant}~{rid}", {"tenant": tenant}, on_finish=url
    )


def _client(secret: str) -> openai.OpenAI:
    return openai.OpenAI(api_key="unused", base_url="http://127.0.0.1:9/v1", webhook_secret=secret)


def _verifies(secret: str, hit) -> bool:
    """Whether both libraries accept the delivery ``hit`` under ``secret`` (and agree)."""
    try:
        standardwebhooks.Webhook(secret).verify(hit.body, hit.headers)
        standard = True
    except standardwebhooks.webhooks.WebhookVerificationError:
        standard = False
    try:
        _client(secret).webhooks.verify_signature(hit.body, hit.headers)
        official = True
    except openai.InvalidWebhookSignatureError:
        official = False
    assert standard == official, (standard, official)
    return standard


def test_a_delivery_retried_twice_verifies_with_both_libraries(
    conn, prefix, dispatcher, rq_worker, secrets, monkeypatch
):
    secret, other = secrets.current("acme"), secrets.current("globex")
    with Receiver("fail:2") as receiver:
        dispatcher("--webhook-allow", "127.0.0.1/32")
        rq_worker()
        result = _submit(conn, prefix, "acme", "hook-1", receiver.url).result(timeout=60)
        hits = receiver.wait_for(3, timeout=60)
    assert len(hits) == 3, f"{len(hits)} attempts arrived"
    ids = {h.headers["webhook-id"] for h in hits}
    assert len(ids) == 1 and [h.body for h in hits] == [hits[0].body] * 3
    last = hits[2]
    assert _verifies(secret, last)
    event = _client(secret).webhooks.unwrap(last.body, last.headers)
    assert event.type == "job.completed" and event.id == ids.pop()
    data = orjson.loads(last.body)["data"]
    assert data["id"] == "hook-1" and data["text"] == result.outputs[0].text
    assert data["metadata"] == {"tenant": "acme"} and data["status"] == "finished"
    assert b"worker" not in last.body and b"acme~" not in last.body
    assert not _verifies(other, last)  # another tenant's secret
    tampered = type(last)(last.path, last.headers, last.body.replace(b"hook-1", b"hook-2"), 0)
    assert not _verifies(secret, tampered)

    later = time.time() + 301  # a replay after the 5-minute tolerance of both libraries
    real_now = datetime.now

    class Later(datetime):
        @classmethod
        def now(cls, tz=None):
            return real_now(tz) + timedelta(seconds=301)

    with monkeypatch.context() as m:
        m.setattr(openai.lib._webhooks.time, "time", lambda: later)
        m.setattr(standardwebhooks.webhooks, "datetime", Later)
        assert not _verifies(secret, last)
    stats = {k.decode(): v.decode() for k, v in conn.hgetall(f"{prefix}:webhook:stats").items()}
    assert stats["failed"] == "2" and stats["delivered"] == "1"
    families = {f.name: f for f in PoolCollector(conn, Keys(prefix)).collect()}
    attempts = {s.labels["outcome"]: s.value for s in families["lorapool_webhook_attempts"].samples}
    assert attempts == {"delivered": 1, "failed": 2, "refused": 0}


def test_a_rotation_signs_with_both_secrets_until_the_old_is_dropped(
    conn, prefix, dispatcher, rq_worker, secrets
):
    old = secrets.current("rot")
    new = secrets.rotate("rot", overlap_s=3600)
    with Receiver() as receiver:
        dispatcher("--webhook-allow", "127.0.0.1/32")
        rq_worker()
        _submit(conn, prefix, "rot", "r-1", receiver.url).result(timeout=60)
        [during] = receiver.wait_for(1, timeout=60)
        assert len(during.headers["webhook-signature"].split()) == 2
        assert _verifies(old, during) and _verifies(new, during)
        secrets.drop_old("rot")
        _submit(conn, prefix, "rot", "r-2", receiver.url).result(timeout=60)
        after = receiver.wait_for(2, timeout=60)[1]
    assert _verifies(new, after) and not _verifies(old, after)


def test_deliveries_that_never_succeed_or_point_inward_are_dead_lettered(
    conn, prefix, dispatcher, rq_worker, secrets
):
    secrets.current("dl")
    with (
        Receiver("status:500") as failing,
        Receiver(host="127.0.0.2") as inward,
        Receiver() as target,
    ):
        bouncer = Receiver(f"redirect:{target.url}")
        dispatcher("--webhook-allow", "127.0.0.1/32", "--webhook-max-attempts", "2")
        rq_worker()
        handles = [
            _submit(conn, prefix, "dl", "fails", failing.url),
            _submit(conn, prefix, "dl", "inward", inward.url),
            _submit(conn, prefix, "dl", "meta", "http://169.254.169.254/latest/meta-data/"),
            _submit(conn, prefix, "dl", "bounce", bouncer.url),
        ]
        for handle in handles:
            handle.result(timeout=60)
        deadline = time.monotonic() + 90
        while conn.xlen(f"{prefix}:webhook:dead") < 4:
            assert time.monotonic() < deadline, conn.xrange(f"{prefix}:webhook:dead")
            time.sleep(0.2)
        bouncer.close()
    dead = {
        f[b"id"].decode(): {k.decode(): v.decode() for k, v in f.items()}
        for _, f in conn.xrange(f"{prefix}:webhook:dead")
    }
    reasons = sorted(d["reason"] for d in dead.values())
    assert any(r.startswith("2 attempts; the last: HTTP 500") for r in reasons), reasons
    assert any("loopback" in r for r in reasons), reasons
    assert any("link-local" in r for r in reasons), reasons
    assert any("HTTP 302 (redirects are not followed)" in r for r in reasons), reasons
    assert len(failing.hits) == 2 and inward.hits == [] and target.hits == []
    assert {d["tenant"] for d in dead.values()} == {"dl"}
