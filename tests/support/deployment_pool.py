"""The deployment conformance tests' pool: the doc's Redis users, a private PostgreSQL
database, the processes of one deployment, and KEDA's scaling rule as KEDA computes it
(tests/integration/test_deployment.py and test_compose.py)."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import httpx
import keda
import redis
from deployment import Manifests, Site
from gateway_procs import wait_until

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "redis-acl.md"
PG_DEFAULT = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
SQL_ROLES = ("lorapool_owner", "lorapool_writer", "lorapool_reader")


def acl_rules() -> dict[str, str]:
    """role -> its (standalone) ACL SETUSER line, from docs/redis-acl.md."""
    blocks = re.findall(r"```acl ([\w-]+)\n(ACL SETUSER [^\n]+)\n```", DOC.read_text())
    return dict(blocks)


def set_users(admin: redis.Redis, passwords: dict[str, str]) -> None:
    """The doc's users, each with the password its role's URL carries."""
    for _role, line in acl_rules().items():
        user = line.split()[2]
        words = [f">{passwords[user]}" if w == ">CHANGE-ME" else w for w in line.split()[2:]]
        admin.execute_command("ACL", "SETUSER", *words)


def url_user(url: str) -> tuple[str, str]:
    parsed = httpx.URL(url.replace("redis://", "http://"))
    return parsed.username, parsed.password


@contextlib.contextmanager
def private_pg(names: dict[str, str]):
    """A database of its own on the test PostgreSQL (created, then dropped with the run's
    roles), or None when none is reachable."""
    from sqlalchemy import create_engine, text

    url = os.environ.get("LORAPOOL_TEST_PG_URL") or PG_DEFAULT
    if not url.startswith("postgresql"):
        yield None
        return
    database = f"lp_deploy_{uuid.uuid4().hex[:10]}"
    try:
        admin = create_engine(
            url, isolation_level="AUTOCOMMIT", connect_args={"connect_timeout": 3}
        )
        with admin.connect() as conn:
            conn.execute(text(f"CREATE DATABASE {database}"))
    except Exception:  # noqa: BLE001 - no server: the SQLite path
        yield None
        return
    try:
        yield url.rsplit("/", 1)[0].split("@")[-1], database
    finally:
        with admin.connect() as conn:
            conn.execute(text(f"DROP DATABASE IF EXISTS {database} WITH (FORCE)"))
            for role in names.values():
                conn.execute(text(f"DROP ROLE IF EXISTS {role}"))
        admin.dispose()


class Pool:
    """The processes of one deployment, their logs, and how to stop them all."""

    def __init__(self, workdir: Path):
        self.workdir, self.procs = workdir, []

    def start(self, *processes):
        for process in processes:
            process.start(self.workdir, self.workdir / f"{process.name}.log")
            self.procs.append(process)
        return list(processes)

    def run(self, process, timeout: float = 120) -> str:
        self.start(process)
        try:
            process.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            process.stop()
        log = self.log(process)
        assert process.proc.returncode == 0, f"{process.name} failed:\n{log}"
        return log

    def log(self, process) -> str:
        return (self.workdir / f"{process.name}.log").read_text(errors="replace")

    def alive(self, process) -> bool:
        assert process.proc.poll() is None, f"{process.name} exited:\n{self.log(process)[-3000:]}"
        return True

    def stop(self):
        for process in reversed(self.procs):
            process.stop()

    def dump(self):
        """What each process said, for a failure's report."""
        for process in self.procs:
            print(f"--- {process.name}\n{self.log(process)[-4000:]}")


def ready(pool: Pool, process, path: str, timeout: float = 90) -> None:
    def answering() -> bool:
        pool.alive(process)
        try:
            return httpx.get(f"{process.url()}{path}", timeout=5).status_code == 200
        except httpx.TransportError:
            return False

    wait_until(answering, f"{process.name} answering {path}", timeout)


def lorapool(*args: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-c", "from lorapool.cli.main import main; main()", *args]
    own = ("REDIS_URL", "LORAPOOL_DB_URL", "LORAPOOL_AUDIT_KEY")  # only what a caller gives
    full = {k: v for k, v in os.environ.items() if k not in own}
    return subprocess.run(cmd, env={**full, **env}, cwd=cwd, capture_output=True, text=True)


# --- KEDA -------------------------------------------------------------------


def keda_wanted(manifests: Manifests, site: Site, redis_port: int) -> int:
    """The worker replicas KEDA asks for (``keda.read``: each redis-streams trigger read as
    its TriggerAuthentication's user, composed by the ScaledObject's scalingModifiers),
    between minReplicaCount and maxReplicaCount; minReplicaCount while inactive."""
    (scaled,) = manifests.of("ScaledObject").values()
    clients = []

    def client_of(trigger: dict) -> redis.Redis:
        auth = manifests.trigger_auth(trigger["authenticationRef"]["name"], "ScaledObject")
        address = trigger["metadata"]["address"]
        host, port = site.localize(f"@{address}").lstrip("@").split(":")
        client = redis.Redis(host=host, port=int(port), username=auth["username"],
                             password=site.localize(auth["password"]))  # fmt: skip
        clients.append(client)
        return client

    try:
        reading = keda.read(scaled, client_of)
    finally:
        for client in clients:
            client.close()
    spec = scaled["spec"]
    if not reading.active:
        return spec.get("minReplicaCount", 0)
    return min(max(reading.wanted, 1, spec.get("minReplicaCount", 0)), spec["maxReplicaCount"])
