"""The Redis ACL rules of docs/redis-acl.md, on a private redis-server.

The users are created from the document itself; a producer, a worker, the
audit writer and ``status`` then each run with their own user only, and each
user is refused what its role does not need. On both pool layouts: a private
standalone redis-server with the doc's ``acl ROLE`` rules, and a private 3-master
Redis Cluster (tests/support/redis_cluster.py), the pool in 3 shards, with its
``acl ROLE cluster`` rules set on every node.
"""

from __future__ import annotations

import asyncio
import re

import pytest
import redis
from acl_users import acl_rules, role_url, set_users
from pool_layout import length
from redis_cluster import private_redis
from standin import load
from worker_loop import looping

from lorapool.audit_db import AuditWriter, DatabaseConfig, WriterConfig, create_audit_engine
from lorapool.audit_db.database import migrate
from lorapool.cli.queue_status import live_workers
from lorapool.connection import connect, connect_async
from lorapool.identity import model_identity
from lorapool.lifecycle.keys import Keys
from lorapool.lifecycle.pool_metrics import PoolCollector
from lorapool.producer import AsyncProducer, Producer
from lorapool.protocol import SamplingParams
from lorapool.records.adapter import ModelIdentity
from lorapool.worker import Worker, WorkerConfig

pytestmark = pytest.mark.integration
LAYOUTS = ("standalone", "cluster")


@pytest.fixture
def server(layout, tmp_path):
    with private_redis(layout, tmp_path / "redis") as server:
        set_users(server, layout)
        yield server


def url(server, role: str) -> str:
    return role_url(server, role)


ROLES = [
    "audit-writer",
    "exporter",
    "gateway",
    "keda",
    "operator",
    "producer",
    "rq-worker",
    "worker",
]


def test_doc_has_every_role():
    for layout in ("standalone", "cluster"):
        assert sorted(acl_rules(layout)) == ROLES


def test_doc_cluster_rules_follow_the_standalone_ones():
    """The same commands on a cluster, but for shard channels' in place of channels' and
    what redis-py's cluster client runs itself (the doc's cluster paragraph)."""
    shard = {"+publish": "+spublish", "+subscribe": "+ssubscribe", "+unsubscribe": "+sunsubscribe"}

    def commands(line: str) -> set[str]:
        return {word for word in line.split() if word[0] in "+-"}

    cluster = acl_rules("cluster")
    for role, line in acl_rules("standalone").items():
        expected = {shard.get(c, c) for c in commands(line)} | {"+cluster|slots", "+command"}
        assert commands(cluster[role]) == expected, role


def test_each_role_runs_with_its_own_user(server, model, tmp_path):
    from lorapool.engine.config import EngineArgs
    from lorapool.engine.llm_engine import LLMEngine

    adapter = tmp_path / "ad"
    adapter.mkdir()
    (adapter / "adapter_model.safetensors").write_bytes(b"weights")
    shards = server.shards
    producer = Producer(url(server, "producer"), shards=shards)
    producer.registry.add("ad", adapter)
    params = SamplingParams(temperature=0.0, max_tokens=3)
    handles = producer.submit_many(["hello", "world", "again"], params)
    handles[2].abort()
    engine = LLMEngine.from_engine_args(EngineArgs(model=model, max_num_seqs=4))
    worker_conn = connect(url(server, "worker"))
    config = WorkerConfig(burst=True, shards=shards)
    Worker(engine, worker_conn, config, model_identity(model)).run()
    outputs = [h.result(timeout=5) for h in handles]
    assert [o.outputs[0].finish_reason for o in outputs[:2]] == ["length", "length"]
    audit_db = create_audit_engine(DatabaseConfig(url=f"sqlite:///{tmp_path / 'audit.db'}"))
    migrate(audit_db)
    writer_conn = connect(url(server, "audit-writer"))
    writer = AuditWriter(writer_conn, audit_db, WriterConfig(shards=shards))
    assert writer.run(burst=True).rows_written == 3
    assert live_workers(producer.redis, producer.keys) == []  # status, as the producer

    async def follow(request_id):  # the async producer's follower: channel and log
        async_producer = AsyncProducer(url(server, "producer"), shards=shards)
        try:
            return await (await async_producer.handle(request_id)).result(timeout=5)
        finally:
            await async_producer.aclose()

    followed = asyncio.run(follow(handles[0].request_id))
    assert followed.outputs[0].token_ids == outputs[0].outputs[0].token_ids

    # the pool's gauges (a gateway's /metrics, run as the producer) read all they need
    gauges = PoolCollector(producer.redis, producer.keys).read()
    assert gauges["lorapool_audit_backlog"][1] == 0  # the writer committed all three
    assert gauges["lorapool_queue_length"][1] == length(producer.redis, producer.keys, "requests")

    keys = producer.keys.for_request("x")  # the keys of a shard (the only one, standalone)
    denied = redis.exceptions.NoPermissionError
    with pytest.raises(denied):  # a producer cannot forge audit records
        producer.redis.xadd(keys.audit, {"data": b"{}"})
    with pytest.raises(denied):  # nor write a chunk log
        producer.redis.xadd(keys.out("x"), {"data": b"{}"})
    with pytest.raises(denied):  # the writer cannot read jobs
        writer_conn.xrange(keys.requests)
    with pytest.raises(denied):  # the worker may publish only on request channels
        (worker_conn.spublish if shards else worker_conn.publish)("elsewhere", b"x")
    with pytest.raises(denied):  # nor touch keys of another prefix
        worker_conn.get(Keys("other", shards).model)
    with pytest.raises(denied):  # and nobody may reconfigure the server
        worker_conn.config_set("appendonly", "no")


def test_the_other_roles_are_refused_what_is_not_theirs(server):
    """The roles the deployment test runs whole (tests/integration/test_deployment.py): what
    each may not do, on both layouts."""
    keys = Keys(shards=server.shards)
    shard = keys.for_request("x")
    denied = redis.exceptions.NoPermissionError
    clients = {
        role: connect(url(server, role))
        for role in ("gateway", "exporter", "keda", "rq-worker", "operator")
    }
    try:
        gateway, exporter, keda = clients["gateway"], clients["exporter"], clients["keda"]
        with pytest.raises(denied):  # the gateway cannot forge audit records
            gateway.xadd(shard.audit, {"data": b"{}"})
        with pytest.raises(denied):  # nor write chunk logs, nor read tenants' secrets
            gateway.rpush(shard.out("x"), b"{}")
        with pytest.raises(denied):
            gateway.hset(keys.api_keys, "k", "v")  # API keys are the operator's to make
        with pytest.raises(denied):  # the exporter writes nothing
            exporter.xadd(shard.requests, {"data": b"{}"})
        with pytest.raises(denied):  # and reads no secret
            exporter.hgetall(keys.webhook_secrets)
        assert keda.xlen(shard.requests) >= 0
        with pytest.raises(denied):  # KEDA reads the streams' counts, not the jobs
            keda.xrange(shard.requests)
        with pytest.raises(denied):
            clients["rq-worker"].xadd(shard.audit, {"data": b"{}"})
        for role in ("gateway", "rq-worker"):  # a job's run is the workers' (issue 48)
            assert clients[role].hget(shard.run("x"), "status") is None
            with pytest.raises(denied):
                clients[role].hset(shard.run("x"), "status", "finished")
        with pytest.raises(denied):  # the operator administers the pool, not the server
            clients["operator"].config_set("appendonly", "no")
        with pytest.raises(denied):
            clients["operator"].flushall()
    finally:
        for client in clients.values():
            client.close()


def test_tenant_security_runs_with_each_roles_user(server):
    """Issue 32's state with the users of the roles that touch it: the gateway takes
    rates (a script on Redis's clock) and reads whether a tenant has a webhook secret;
    the audit writer puts deliveries in tenants' lanes and enqueues them in RQ; an RQ
    worker leases, counts and dead-letters them, reads the tenant's secrets and paces a
    batch by its owner key's limits; the operator makes secrets and keys."""
    from lorapool.batch.deliveries import Lanes, WebhookConfig
    from lorapool.batch.pacing import Pacer
    from lorapool.batch.webhook_secrets import WebhookSecrets
    from lorapool.lifecycle.rate_limits import RateLimiter
    from lorapool.producer.api_keys import ApiKeys

    keys = Keys(shards=server.shards)
    operator, gateway, writer, rq = (
        connect(url(server, role)) for role in ("operator", "gateway", "audit-writer", "rq-worker")
    )
    try:
        secret = WebhookSecrets(operator, keys).current("acme")
        record, _ = ApiKeys(operator, keys).add("acme", "submit", rpm=60, tpm=1000)
        assert RateLimiter(gateway, keys).take("acme", 60, 1000, 1, 10).taken
        assert gateway.hexists(keys.webhook_secrets, "acme")

        async def session() -> str | None:  # a dashboard login's session, as the gateway
            from lorapool.gateway.dashboard_session import Sessions

            client = connect_async(url(server, "gateway"))
            try:
                sessions = Sessions(client, keys, 60)
                return await sessions.key_id(await sessions.create(record))
            finally:
                await client.aclose()

        assert asyncio.run(session()) == record.id
        if not server.shards:  # RQ (the lanes' executor) runs on a standalone Redis only
            config = WebhookConfig(keys.prefix, keys.shards, queue="acl-test-callbacks")
            delivery = "msg_" + "0" * 36
            assert Lanes(writer, config).push(delivery, "acme", "https://x.example/", b"{}")
            lanes = Lanes(rq, config)
            lanes.renew("acme", delivery)
            lanes.count("failed", 0.5)
            lanes.dead(delivery, {"tenant": "acme", "url": "u", "attempts": "1"}, "gone")
            lanes.release("acme", delivery)
            assert lanes.pump("acme") == 0
        assert WebhookSecrets(rq, keys).valid("acme") == [secret]
        pacer = Pacer(rq, keys, {"tenant": "acme", "key_id": record.id})
        assert pacer.rpm == 60 and pacer.limiter.take("acme", 60, 1000, 1, 10).taken
    finally:
        for client in (operator, gateway, writer, rq):
            client.close()


def test_a_reader_ends_an_unread_request_with_its_roles_user(server, tmp_path):
    """A producer's, a gateway's and an RQ worker's handles (sync, and the async
    follower) get the end of a request whose queue entry an operator removed before any
    worker read it (issue 31 Build 2): the check and the push of its id for the workers
    are within each role's rights; a worker, as its user, ends the requests and writes
    their audit records (issue 48), and the audit writer, as its user, stores one row
    each. Readers may push ids for the workers but not read them, nor write the run."""
    from lorapool.lifecycle.unread import REASON
    from lorapool.worker import unread_audit

    admin = connect(server.url)
    params = SamplingParams(max_tokens=2)
    roles = ("producer", "gateway", "rq-worker")
    config = WorkerConfig(shards=server.shards, name="w")
    engine = load().StandInEngine(8, 0.001)
    worker = Worker(engine, connect(url(server, "worker")), config, ModelIdentity("m", "0"))
    worker.ensure_group()
    try:
        for role in roles:
            producer = Producer(url(server, role), shards=server.shards)
            handle = producer.submit("hi", params, request_id=f"unread-{role}")
            following = producer.submit("hi", params, request_id=f"unread-async-{role}")

            async def follow(rid, role=role):
                reader = AsyncProducer(url(server, role), shards=server.shards)
                try:
                    return await (await reader.handle(rid)).result(timeout=30)
                finally:
                    await reader.aclose()

            for rid in (handle.request_id, following.request_id):
                admin.xtrim(producer.keys.for_request(rid).requests, maxlen=0, approximate=False)
            with looping(worker):  # the reader asks, a live worker ends it
                assert handle.result(timeout=30).error == REASON
                assert asyncio.run(follow(following.request_id)).error == REASON
            with pytest.raises(redis.exceptions.NoPermissionError):
                producer.redis.lrange(
                    producer.keys.for_request(handle.request_id).unread_ended, 0, -1
                )
            with pytest.raises(redis.exceptions.NoPermissionError):
                producer.redis.hset(producer.keys.run(handle.request_id), "status", "queued")
        assert unread_audit.record_ended(worker.state) == 0  # all ended already
        audit_db = create_audit_engine(DatabaseConfig(url=f"sqlite:///{tmp_path / 'audit.db'}"))
        migrate(audit_db)
        writer_conn = connect(url(server, "audit-writer"))
        writer = AuditWriter(writer_conn, audit_db, WriterConfig(shards=server.shards))
        assert writer.run(burst=True).rows_written == 2 * len(roles)
        writer_conn.close()
        worker.redis.close()
    finally:
        admin.close()


def test_a_reader_with_older_rules_writes_nothing_and_waits(server, layout):
    """Readers whose users have rules older than the doc's: one without XPENDING cannot
    tell whether a worker holds an entry, so it leaves a held request whose entry was
    trimmed alone (the worker's to end); one without the push to ``unread-ended`` is
    refused before END_UNREAD writes anything. Each reader raises nothing but its
    timeout, and the marker stays queued."""
    from lorapool.connection import ensure_group
    from lorapool.lifecycle.keys import WORKERS_GROUP

    rules = acl_rules(layout)["producer"]
    stale = {
        "no-xpending": rules.replace(" +xpending", ""),
        "no-push": re.sub(r" %W~\S*unread-ended", "", rules),
    }
    admin = connect(server.url)
    try:
        for name, line in stale.items():
            line = line.replace("lorapool-producer", f"lorapool-{name}")
            assert line != rules.replace("lorapool-producer", f"lorapool-{name}")
            for node in server.nodes:
                client = node.client()
                client.execute_command(*line.split())
                client.close()
            producer = Producer(url(server, name), shards=server.shards)
            rid = f"stale-{name}"
            stream = producer.keys.for_request(rid).requests
            ensure_group(admin, stream, WORKERS_GROUP)
            handle = producer.submit("hi", SamplingParams(max_tokens=2), request_id=rid)
            if name == "no-xpending":  # held by a worker, with nothing written yet
                assert admin.xreadgroup(WORKERS_GROUP, "someone", {stream: ">"}, count=1)
            admin.xtrim(stream, maxlen=0, approximate=False)
            with pytest.raises(TimeoutError):
                handle.result(timeout=3)
            assert admin.hget(producer.keys.job(rid), "status") == b"queued"
            assert admin.llen(producer.keys.for_request(rid).unread_ended) == 0
    finally:
        admin.close()


def test_a_reader_ends_a_run_stopped_partway_with_its_roles_user(server):
    """A run a killed worker began, whose entry an operator deleted and another worker's
    claim dropped (issue 31 Build 2, ``lifecycle/orphaned.py``): a producer's and an RQ
    worker's handles and the gateway's follower get its end with their roles' users (the
    log read by LRANGE only), and a worker, as its user, ends the runs, writes the audit
    records and lets the logs expire."""
    from lorapool.lifecycle.keys import WORKERS_GROUP
    from lorapool.lifecycle.orphaned import REASON

    def worker(name: str) -> Worker:
        config = WorkerConfig(shards=server.shards, name=name, lease_s=1.0)
        made = Worker(
            load().StandInEngine(8, 0.005),
            connect(url(server, "worker")),
            config,
            ModelIdentity("m", "0"),
        )
        made.ensure_group()
        return made

    admin, killed, survivor = connect(server.url), worker("killed"), worker("survivor")
    roles = ("producer", "gateway", "rq-worker")
    params = SamplingParams(max_tokens=500, ignore_eos=True)
    producers = {role: Producer(url(server, role), shards=server.shards) for role in roles}
    keys = {role: p.keys.for_request(f"ran-{role}") for role, p in producers.items()}
    try:
        for role, producer in producers.items():
            producer.submit("hi", params, request_id=f"ran-{role}")
        while any(admin.llen(keys[role].out(f"ran-{role}")) < 2 for role in roles):
            killed.run_guarded()
        killed.publisher.close()  # SIGKILL: nothing of it reaches Redis any more
        for role in roles:
            view, rid = keys[role], f"ran-{role}"
            assert admin.xdel(view.requests, admin.hget(view.job(rid), "entry")) == 1
        while any(admin.xpending(k.requests, WORKERS_GROUP)["pending"] for k in keys.values()):
            survivor.run_guarded()  # its claim drops the deleted entries

        async def follow(rid):
            reader = AsyncProducer(url(server, "gateway"), shards=server.shards)
            try:
                return await (await reader.handle(rid)).result(timeout=30)
            finally:
                await reader.aclose()

        with looping(survivor):
            for role in ("producer", "rq-worker"):
                output = producers[role].handle(f"ran-{role}").result(timeout=30)
                assert output.error == REASON and output.outputs[0].token_ids
            assert asyncio.run(follow("ran-gateway")).error == REASON
        audits = {view.audit for view in keys.values()}  # each stream once
        assert sum(admin.xlen(audit) for audit in audits) == len(roles)
        for role in roles:
            assert 0 < admin.ttl(keys[role].out(f"ran-{role}")) <= survivor.config.log_grace_s
    finally:
        for made in (killed, survivor):
            made.redis.close()
        for producer in producers.values():
            producer.redis.close()
        admin.close()
