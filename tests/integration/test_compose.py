"""The deployment conformance test of compose.yaml: its Redis users must be the doc's;
every service runs as a local process (one worker, one gateway), each with the Redis
user compose gives it, the operator's command, one completion through the gateway; a
manifest or compose file that names what does not exist fails the check
(tests/support/deployment.py says how a container becomes a process).
"""

from __future__ import annotations

import uuid

import httpx
import pytest
from deployment import Compose, Manifests, MissingReference, Site
from deployment_pool import (
    SQL_ROLES,
    Pool,
    acl_rules,
    lorapool,
    private_pg,
    ready,
)
from gateway_procs import free_port
from redis_server import RedisServer

pytestmark = pytest.mark.integration


# --- compose.yaml -----------------------------------------------------------


def test_compose_redis_users_are_the_docs():
    compose = Compose({})
    command = compose.argv("redis")
    users = " ".join(command).split(" --user ")[1:]
    got = {u.split()[0]: u.split() for u in users}
    assert got.pop("default") == ["default", "off"]
    for line in acl_rules().values():
        words = line.split()[2:]
        user = words[0]
        assert [w for w in got[user] if not w.startswith(">")] == [
            w for w in words if not w.startswith(">")
        ], user


def test_manifests_name_only_what_exists(tmp_path):
    """The check that fails a manifest naming what deploy/ lacks is real."""
    manifests = Manifests()
    broken = manifests.of("Deployment")["lorapool-gateway"]
    broken["spec"]["template"]["spec"]["containers"][0]["env"][0]["valueFrom"]["secretKeyRef"][
        "key"
    ] = "nope"
    with pytest.raises(MissingReference, match="nope"):
        manifests.check_references()
    manifests = Manifests()
    container = manifests.of("Deployment")["lorapool-worker"]["spec"]["template"]["spec"]
    container["containers"][0]["env"].append({"name": "LORAPOOL_NO_SUCH_SETTING", "value": "1"})
    with pytest.raises(MissingReference, match="LORAPOOL_NO_SUCH_SETTING"):
        manifests.check_references()
    manifests = Manifests()
    container = manifests.of("Deployment")["lorapool-gateway"]["spec"]["template"]["spec"]
    container["volumes"][0]["secret"]["secretName"] = "lorapool-elsewhere"
    with pytest.raises(MissingReference, match="lorapool-elsewhere"):
        manifests.check_references()
    compose = Compose({})
    compose.services["worker"]["environment"]["LORAPOOL_NO_SUCH_SETTING"] = "1"
    with pytest.raises(MissingReference, match="LORAPOOL_NO_SUCH_SETTING"):
        compose.check_references()


def test_compose_runs_as_written(tmp_path, tree, audit_key_text):
    """Every service of compose.yaml as a process (one worker, one gateway), each with the
    Redis user compose gives it, on a Redis started with compose's users."""
    compose = Compose({"LORAPOOL_MODEL": "base", "LORAPOOL_DEVICE": "cpu"})
    compose.check_references()
    users = compose.argv("redis")[1:]
    users = users[: users.index("--user")] + users[users.index("--user") + 3 :]  # default off:
    # the test's admin is the default user
    server = RedisServer(tmp_path / "redis", args=tuple(users)).start()
    admin = server.client()
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    (secrets / "audit_key").write_text(audit_key_text)
    mounts = {"/run/secrets": secrets, "/models": tree / "models", "/adapters": tree / "adapters"}
    suffix = uuid.uuid4().hex[:8]
    sql_names = {role: f"{role}_{suffix}" for role in SQL_ROLES}
    pool = Pool(tmp_path / "run")
    pool.workdir.mkdir()
    try:
        with private_pg(sql_names) as pg:
            site = compose_site(server.port, pg, sql_names, mounts, tmp_path)
            try:
                _drive_compose(compose, site, pool, pg, sql_names, admin)
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


def compose_site(redis_port, pg, sql_names, mounts, tmp_path) -> Site:
    replace, hosts = {}, {"redis": f"127.0.0.1:{redis_port}"}
    if pg is None:
        sqlite = f"sqlite:///{tmp_path / 'audit.sqlite'}"
        pattern = "postgresql+psycopg://lorapool_{}:change-me-{}@postgres:5432/lorapool"
        replace.update({pattern.format(r, r): sqlite for r in ("writer", "reader")})
    else:
        address, database = pg
        hosts["postgres"] = address
        replace["postgres:5432/lorapool"] = f"postgres:5432/{database}"
        replace.update({f"{role}:": f"{name}:" for role, name in sql_names.items()})
    return Site(hosts=hosts, mounts=mounts, workdir=tmp_path, replace=replace)


def _drive_compose(compose, site, pool, pg, sql_names, admin):
    if pg is not None:
        (setup,) = compose.processes("audit-setup", site, free_port)
        setup.argv += [f"--{r.split('_')[1]}={n}" for r, n in sql_names.items()]
        pool.run(setup)
        db_env = {}
    else:
        print("no PostgreSQL reachable: audit-setup skipped, SQLite migrated instead")
        db_env = {"LORAPOOL_DB_SCHEMA": ""}
        (writer,) = compose.processes("audit-writer", site, free_port)
        done = lorapool(
            "audit",
            "migrate",
            env={"LORAPOOL_DB_URL": writer.env["LORAPOOL_DB_URL"]},
            cwd=pool.workdir,
        )
        assert done.returncode == 0, done.stderr
    (gateway,) = pool.start(*compose.processes("gateway", site, free_port))
    (writer,) = compose.processes("audit-writer", site, free_port)
    writer.env.update(db_env)
    (worker,) = compose.processes("worker", site, free_port)
    (exporter,) = compose.processes("exporter", site, free_port)
    pool.start(writer, worker, exporter)
    pool.start(*compose.processes("rq-batch", site, free_port))
    pool.start(*compose.processes("rq-callbacks", site, free_port))
    ready(pool, gateway, "/readyz?min_workers=1", timeout=180)
    (operator,) = compose.processes("operator", site, free_port)
    assert "lorapool:requests" in pool.run(operator)  # `lorapool status`
    operator_env = {"REDIS_URL": operator.env["REDIS_URL"]}
    made = lorapool("keys", "add", "acme", env=operator_env, cwd=pool.workdir)
    assert made.returncode == 0, made.stderr
    import openai

    client = openai.OpenAI(
        base_url=f"{gateway.url()}/v1", api_key=made.stdout.strip(), max_retries=0, timeout=120
    )
    done = client.completions.create(model="base", prompt="Hello", max_tokens=4)
    assert done.choices[0].finish_reason in ("length", "stop")
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{exporter.url()}/metrics", timeout=30).text
    live = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert live["lorapool_workers_live"] == 1
    assert httpx.get(f"{worker.url('--metrics-port')}/metrics", timeout=30).status_code == 200
    assert [e for e in admin.acl_log(count=1000)] == []
