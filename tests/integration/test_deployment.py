"""The deployment conformance test: deploy/'s manifests and compose.yaml run as written,
as local processes, without Docker or Kubernetes (tests/support/deployment.py says how a
container becomes a process).

deploy/ (and the Helm chart deploy/helm/lorapool as `helm template` renders it with its
default values, the same test run on its resources): every Deployment and Job its
manifests define, with their commands, arguments, environment and mounted Secrets; each
role connects with its own Redis user (the rules of docs/redis-acl.md, with the
passwords of deploy/examples/secrets.example.yaml) on a private redis-server; 2 gateway
replicas, as gateway.yaml says; the audit roles made by the audit-setup Job in a private
PostgreSQL database (SQLite and `audit migrate` when no PostgreSQL is reachable). The
pool starts with no worker, as KEDA leaves it: a job is accepted and queued, KEDA's loop
(tests/support/keda.py on the ScaledObject the manifests or the chart define: its
triggers read as the TriggerAuthentication's user, its scalingModifiers, pollingInterval
and cooldownPeriod on a simulated clock) asks for one worker, which starts and finishes
it; the worker running a long job alone (pending 1, lag 0) is kept poll after poll past
the cooldown, and once the job ended the loop scales to zero one cooldown later, not
before. Then a user drives the pool: the official openai client (completions, chat,
streaming, an adapter) on both replicas, a job's events resumed with Last-Event-ID on
the other replica, a batch file uploaded to one replica and read back from the other
(run by the RQ worker), an audit query, /metrics of the exporter, the worker and a
gateway (with an audit key, as the chart's ServiceMonitor sends; 401 without one)
scraped and parsed, `lorapool audit verify`. A command run with another role's user
fails with one line. Redis's ACL LOG then holds no refusal of any role that ran: every
user had enough.

compose.yaml's own test: test_compose.py; the pool's helpers: tests/support/deployment_pool.py.

Replicas other than the gateway's: one each (2 CPU cores); the test's own admin is the
Redis default user. What it costs: about 60-90 s on an idle 2-core machine.
"""

from __future__ import annotations

import contextlib
import uuid
from pathlib import Path

import httpx
import orjson
import pytest
from deployment import Manifests, Site
from deployment_pool import (
    SQL_ROLES,
    Keda,
    Pool,
    lorapool,
    private_pg,
    ready,
    set_users,
    url_user,
)
from gateway_procs import free_port, wait_until
from redis_server import RedisServer

pytestmark = pytest.mark.integration


# --- deploy/ ----------------------------------------------------------------


def chart_manifests() -> Manifests:
    """deploy/helm/lorapool as `helm template` renders it with its default values, with
    the example Secrets it names (tests/support/helm_chart.py; skips without helm)."""
    from helm_chart import example_secrets, render

    return Manifests(resources=render() + example_secrets())


@pytest.mark.parametrize("source", ["deploy", "helm"])
def test_deploy_runs_as_written(tmp_path, tree, model, audit_key_text, source):
    """deploy/'s manifests, then the Helm chart's rendering, run as written."""
    manifests = chart_manifests() if source == "helm" else Manifests()
    manifests.check_references()
    secrets = manifests.of("Secret")["lorapool-redis"]["stringData"]
    passwords = dict(url_user(v) for k, v in secrets.items() if k.endswith("-url"))
    passwords[secrets["keda-username"]] = secrets["keda-password"]
    server = RedisServer(tmp_path / "redis").start()
    admin = server.client()
    set_users(admin, passwords)
    suffix = uuid.uuid4().hex[:8]
    sql_names = {role: f"{role}_{suffix}" for role in SQL_ROLES}
    pool = Pool(tmp_path / "run")
    pool.workdir.mkdir()
    mounts = {
        "/secrets/audit": tmp_path / "secrets" / "audit",
        "/models": tree / "models",
        "/adapters": tree / "adapters",
        "/tmp": tmp_path / "pod-tmp",  # the chart's emptyDir under a read-only root
    }
    (mounts["/secrets/audit"]).mkdir(parents=True)
    mounts["/tmp"].mkdir()
    try:
        with private_pg(sql_names) as pg:
            site = deploy_site(
                manifests, server.port, pg, sql_names, mounts, tmp_path, audit_key_text
            )
            mounts["/secrets/audit"].joinpath("audit.key").write_text(
                site.localize(manifests.secret("lorapool-audit-key", "audit.key", "test"))
            )
            try:
                _drive_deploy(manifests, site, pool, pg, sql_names, admin, tmp_path)
            except BaseException:
                pool.stop()
                pool.dump()
                for entry in admin.acl_log(count=200):
                    print("ACL LOG", entry["username"], entry["reason"], entry["object"])
                raise
    finally:
        pool.stop()
        admin.close()
        server.stop()


def deploy_site(manifests, redis_port, pg, sql_names, mounts, tmp_path, audit_key) -> Site:
    replace = {"CHANGE-ME-run-lorapool-audit-keygen": audit_key}
    hosts = {"redis.lorapool.svc": f"127.0.0.1:{redis_port}"}
    db = manifests.of("Secret")["lorapool-db"]["stringData"]
    if pg is None:  # SQLite: one file for the writer and the gateway's reads
        sqlite = f"sqlite:///{tmp_path / 'audit.sqlite'}"
        replace.update({db["writer-url"]: sqlite, db["reader-url"]: sqlite})
    else:
        address, database = pg
        hosts["postgres.lorapool.svc"] = address
        replace["svc:5432/lorapool"] = f"svc:5432/{database}"
        replace.update({f"{role}:": f"{name}:" for role, name in sql_names.items()})
    return Site(hosts=hosts, mounts=mounts, workdir=tmp_path, replace=replace)


def _drive_deploy(manifests, site, pool, pg, sql_names, admin, tmp_path):
    secrets = {
        k: site.localize(v)
        for k, v in manifests.of("Secret")["lorapool-redis"]["stringData"].items()
    }
    db = {
        k: site.localize(v) for k, v in manifests.of("Secret")["lorapool-db"]["stringData"].items()
    }
    if pg is not None:  # the audit-setup Job, its role names this run's own
        (setup,) = manifests.processes("lorapool-audit-setup", site, free_port)
        setup.argv += [f"--{r.split('_')[1]}={n}" for r, n in sql_names.items()]
        assert "revision" in pool.run(setup)
    else:
        reason = "no PostgreSQL reachable: the audit-setup Job skipped, SQLite migrated instead"
        print(reason)
        done = lorapool(
            "audit", "migrate", env={"LORAPOOL_DB_URL": db["writer-url"]}, cwd=pool.workdir
        )
        assert done.returncode == 0, done.stderr
    gateways = pool.start(*manifests.processes("lorapool-gateway", site, free_port))
    assert len(gateways) == 2  # as gateway.yaml says
    pool.start(*manifests.processes("lorapool-audit-writer", site, free_port))
    (exporter,) = pool.start(*manifests.processes("lorapool-exporter", site, free_port))
    pool.start(*manifests.processes("lorapool-rq-batch", site, free_port, replicas=1))
    pool.start(*manifests.processes("lorapool-rq-callbacks", site, free_port, replicas=1))
    for gateway in gateways:  # ready with no worker at all: scale from zero
        ready(pool, gateway, "/readyz")
        assert httpx.get(f"{gateway.url()}/readyz").json()["workers"] == 0

    operator = {"REDIS_URL": secrets["operator-url"]}
    added = lorapool(
        "adapters",
        "add",
        "ad",
        str(site.mounts["/adapters"] / "ad"),
        env=operator,
        cwd=pool.workdir,
    )
    assert added.returncode == 0, added.stderr
    keys = {}
    for tenant, role, extra in (("acme", "submit", ()), ("audit", "audit", ("--all-tenants",))):
        made = lorapool(
            "keys", "add", tenant, "--role", role, *extra, env=operator, cwd=pool.workdir
        )
        assert made.returncode == 0, made.stderr
        keys[role] = made.stdout.strip()
    auth = {"Authorization": f"Bearer {keys['submit']}"}

    a, b = (g.url() for g in gateways)
    with contextlib.closing(Keda(manifests, site)) as scaler:
        worker = _scale_from_zero(manifests, site, pool, scaler, a, b, auth)
        _keda_keeps_a_busy_worker(pool, worker, scaler, a, auth)

    _as_a_user(a, b, keys, auth, tmp_path)
    _metrics(pool, exporter, worker, gateways, keys)
    _dashboard(pool, secrets["exporter-url"], db["reader-url"] if pg else None)
    verify = lorapool(
        "audit",
        "verify",
        env={
            "LORAPOOL_DB_URL": db["reader-url"],
            "LORAPOOL_AUDIT_KEY_FILE": str(site.mounts["/secrets/audit"] / "audit.key"),
            **({"LORAPOOL_DB_SCHEMA": "lorapool_audit"} if pg else {}),
        },
        cwd=pool.workdir,
    )
    assert verify.returncode == 0, verify.stdout + verify.stderr

    # the wrong role: one line naming what Redis refused, no traceback; a gateway run as
    # the producer answers 503 naming it, not a 500
    wrong = lorapool("keys", "list", env={"REDIS_URL": secrets["producer-url"]}, cwd=pool.workdir)
    assert wrong.returncode == 1 and "Traceback" not in wrong.stderr
    assert len(wrong.stderr.strip().splitlines()) == 1 and "NOPERM" in wrong.stderr, wrong.stderr
    (as_producer,) = manifests.processes("lorapool-gateway", site, free_port, replicas=1)
    as_producer.env["REDIS_URL"] = secrets["producer-url"]
    pool.start(as_producer)
    ready(pool, as_producer, "/healthz")
    assert (
        httpx.get(f"{as_producer.url()}/readyz").json()["error"]["code"]
        == "redis_permission_denied"
    )
    refused = httpx.get(f"{as_producer.url()}/v1/models", headers=auth)
    assert refused.status_code == 503, refused.text
    assert refused.json()["error"]["code"] == "redis_permission_denied"
    assert "no permissions to access one of the keys" in refused.json()["error"]["message"]

    refused = [
        entry for entry in admin.acl_log(count=1000) if entry["username"] != "lorapool-producer"
    ]
    assert refused == [], refused


def _scale_from_zero(manifests, site, pool, scaler, a, b, auth):
    """Queued, KEDA's loop wakes the pool with one worker, which starts and finishes it."""
    job = httpx.post(
        f"{a}/v1/jobs", headers=auth, json={"model": "ad", "prompt": "hello", "max_tokens": 6}
    )
    assert job.status_code == 202, job.text
    assert scaler.wanted() == 1
    wanted = scaler.poll()
    assert wanted == 1
    (worker,) = pool.start(
        *manifests.processes("lorapool-worker", site, free_port, replicas=wanted)
    )
    job_id = job.json()["id"]
    wait_until(
        lambda: pool.alive(worker) and _status(b, job_id, auth) == "finished",
        "the queued job finished",
        180,
    )
    assert scaler.wanted() == 0
    return worker


def _keda_keeps_a_busy_worker(pool, worker, scaler, url, auth) -> None:
    """Steady load a worker keeps up with: at every poll one job runs (pending 1) and
    none waits (lag 0). The worker is kept, poll after poll past the cooldown (the lag
    alone read 0 and scaled it to zero); once the load stops KEDA waits one cooldown,
    then scales to zero."""
    loop, job_id = scaler.loop, None
    for _ in range(loop.cooldown // loop.interval + 1):
        if job_id is None or _status(url, job_id, auth) != "running":
            job_id = _one_running(pool, worker, url, auth)
        assert scaler.poll() == 1, f"a busy worker scaled to {loop.replicas} at t={loop.now}s"
    if _status(url, job_id, auth) == "running":  # 200: it finished in between (CI once)
        assert httpx.delete(f"{url}/v1/jobs/{job_id}", headers=auth).status_code in (200, 202)
    wait_until(lambda: _status(url, job_id, auth) in ENDED, "the last job ended", 60)
    busy_until = loop.last_active
    while scaler.poll() > 0:
        assert loop.now - busy_until < loop.cooldown
    assert loop.now - busy_until == loop.cooldown  # zero one cooldown after the load


ENDED = ("finished", "failed", "aborted")


def _one_running(pool, worker, url, auth) -> str:
    """A job submitted and seen running (one that ended before it was seen is replaced)."""
    body = {"model": "ad", "prompt": "count", "max_tokens": 400, "ignore_eos": True}
    for _ in range(5):
        submitted = httpx.post(f"{url}/v1/jobs", headers=auth, json=body)
        assert submitted.status_code == 202, submitted.text
        job_id = submitted.json()["id"]
        wait_until(
            lambda j=job_id: pool.alive(worker) and _status(url, j, auth) in ("running", *ENDED),
            "the job taken",
            120,
        )
        if _status(url, job_id, auth) == "running":
            return job_id
    raise AssertionError("five jobs of 400 tokens each ended before they were seen running")


def _status(url: str, job_id: str, auth: dict) -> str:
    return httpx.get(f"{url}/v1/jobs/{job_id}", headers=auth).json()["status"]


def _as_a_user(a: str, b: str, keys: dict, auth: dict, tmp_path: Path) -> None:
    import openai

    clients = [
        openai.OpenAI(base_url=f"{u}/v1", api_key=keys["submit"], max_retries=0, timeout=120)
        for u in (a, b)
    ]
    base = "base"
    done = clients[0].completions.create(model=base, prompt="Hello", max_tokens=5, temperature=0)
    assert done.choices[0].finish_reason in ("length", "stop")
    chat = clients[1].chat.completions.create(
        model="ad", messages=[{"role": "user", "content": "hi"}], max_tokens=5
    )
    assert chat.model == "ad" and chat.choices[0].message.content is not None
    stream = clients[0].chat.completions.create(
        model=base, messages=[{"role": "user", "content": "hi"}], max_tokens=6, stream=True
    )
    assert sum(len(c.choices[0].delta.content or "") for c in stream if c.choices) > 0

    # a job's events on one replica, resumed on the other with Last-Event-ID
    body = {"model": "ad", "prompt": "count", "max_tokens": 16, "ignore_eos": True}
    job_id = httpx.post(f"{a}/v1/jobs", headers=auth, json=body).json()["id"]
    events = _events(a, job_id, auth)
    assert len(events) >= 3 and events[-1][1]["finished"]
    middle = len(events) // 2
    assert _events(b, job_id, {**auth, "Last-Event-ID": events[middle][0]}) == events[middle + 1 :]

    # a batch: uploaded to one replica, created and read back on the other
    lines = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": ["ad", base][i % 2], "prompt": f"line {i}", "max_tokens": 4}}
             for i in range(4)]  # fmt: skip
    source = tmp_path / "batch.jsonl"
    source.write_bytes(b"".join(orjson.dumps(x) + b"\n" for x in lines))
    uploaded = clients[0].files.create(file=source.open("rb"), purpose="batch")
    batch = clients[1].batches.create(
        input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h"
    )
    wait_until(
        lambda: clients[0].batches.retrieve(batch.id).status in ("completed", "failed"),
        "the batch",
        180,
    )
    finished = clients[1].batches.retrieve(batch.id)
    assert finished.status == "completed", finished
    output = clients[0].files.content(finished.output_file_id).text.splitlines()
    assert sorted(orjson.loads(x)["custom_id"] for x in output) == [f"c{i}" for i in range(4)]
    assert all(orjson.loads(x)["response"]["status_code"] == 200 for x in output)

    # an audit query: the job's row, as the auditor's key sees it
    audit = {"Authorization": f"Bearer {keys['audit']}"}

    def audited() -> bool:
        rows = httpx.get(
            f"{b}/v1/audit/completions", headers=audit, params={"tenant": "acme"}
        ).json()
        return any(job_id in row["request_id"] for row in rows.get("data", []))

    wait_until(audited, "the job's audit row", 60)
    verified = httpx.get(f"{a}/v1/audit/verify", headers=audit, params={"wait": 30}, timeout=60)
    assert verified.status_code == 200, verified.text  # a job any replica reads, in Redis


def _dashboard(pool: Pool, exporter_url: str, audit_db_url: str | None) -> None:
    """`lorapool dashboard` as the exporter's user (docs/redis-acl.md: exporter and
    dashboard): its page and gauges, with the audit rows when there is PostgreSQL."""
    from deployment import Process, executable

    port = free_port()
    argv = executable("lorapool") + ["dashboard", "--port", str(port)]
    env = {"REDIS_URL": exporter_url}
    if audit_db_url is not None:
        argv += ["--audit-db-url", audit_db_url, "--audit-db-schema", "lorapool_audit"]
    (dashboard,) = pool.start(Process("dashboard", argv, env, {"--port": port}))
    ready(pool, dashboard, "/dashboard")
    page = httpx.get(f"{dashboard.url()}/dashboard", timeout=30)
    assert page.status_code == 200 and "worker" in page.text.lower()
    assert httpx.get(f"{dashboard.url()}/metrics", timeout=30).status_code == 200


def _events(url: str, job_id: str, headers: dict) -> list:
    events, current = [], {}
    with httpx.stream(
        "GET", f"{url}/v1/jobs/{job_id}/events", headers=headers, timeout=120
    ) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if not line:
                if "data" in current:
                    events.append((current.get("id"), orjson.loads(current["data"])))
                current = {}
                continue
            field, _, value = line.partition(": ")
            current[field] = value
    return events


def _metrics(pool, exporter, worker, gateways, keys) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    def samples(url: str, headers=None) -> dict:
        text = httpx.get(f"{url}/metrics", headers=headers or {}, timeout=30).text
        return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}

    pool_gauges = samples(exporter.url())
    assert pool_gauges["lorapool_workers_live"] == 1
    assert pool_gauges["lorapool_queue_length"] >= 0
    assert "lorapool_audit_backlog" in pool_gauges
    worker_metrics = samples(worker.url("--metrics-port"))
    assert any(name.startswith("lorapool_") for name in worker_metrics)
    assert httpx.get(f"{gateways[1].url()}/metrics", timeout=30).status_code == 401
    gateway_metrics = samples(gateways[1].url(), {"Authorization": f"Bearer {keys['audit']}"})
    assert gateway_metrics["lorapool_workers_live"] == 1
