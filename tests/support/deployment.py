"""compose.yaml and deploy/'s manifests as local processes, for the conformance test.

What a container gets, a process gets: the command and its arguments (Kubernetes'
``$(VAR)`` and compose's ``${VAR:-default}`` expanded as they would be), its
environment (a Secret's key through ``secretKeyRef``), its mounted Secrets as files.
Where a machine differs from a cluster, one rule each, applied to every argument and
variable alike:

- a Service's host name (``redis.lorapool.svc``, compose's ``redis``) becomes the
  127.0.0.1 address of the private server playing it (``Site.hosts``);
- a listening port (``--port``, ``--metrics-port``) becomes a free one for each
  replica, and a listen address 127.0.0.1;
- a mount path (``/secrets/audit``, ``/models``, ``/adapters``, ``/run/secrets``)
  becomes a directory of the test's (``Site.mounts``);
- ``lorapool`` and ``rq`` are this interpreter's.

Anything a manifest names that does not exist (a Secret or a key of it, a volume, a
claim, a TriggerAuthentication, a Deployment a ScaledObject scales) raises
``MissingReference``: a manifest that names what deploy/ never defines fails the test.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
COMPOSE = ROOT / "compose.yaml"
# what KEDA's redis-streams trigger reads (keda.sh/docs/scalers/redis-streams)
KEDA_REDIS_STREAMS = {
    "address", "host", "port", "usernameFromEnv", "passwordFromEnv", "stream",
    "consumerGroup", "pendingEntriesCount", "streamLength", "lagCount",
    "activationLagCount", "enableTLS", "unsafeSsl", "databaseIndex",
    "addressFromEnv", "hostFromEnv", "portFromEnv",
}  # fmt: skip
LISTEN_PORTS = ("--port", "--metrics-port")
LISTEN_HOSTS = ("--host", "--metrics-host")


class MissingReference(AssertionError):
    """A manifest names a resource, a key or a variable that does not exist."""


_SOURCES = ("lorapool", "gateway", "worker", "producer", "audit_db", "engine")


def read_by_code(name: str) -> bool:
    """Whether lorapool's code (or rq's command line, for RQ_*) reads the variable
    ``name``: its name appears in a source file."""
    import rq

    roots = [ROOT / d for d in _SOURCES] + [Path(rq.__file__).parent]
    return any(name in p.read_text(errors="ignore") for r in roots for p in r.rglob("*.py"))


def check_env_names(names, by: str) -> None:
    for name in names:
        if not read_by_code(name):
            raise MissingReference(f"{by} sets {name}, which nothing of lorapool reads")


@dataclass
class Site:
    """Where the processes run: host name -> "127.0.0.1:port", a Secret's value ->
    the value to use instead (passwords, the audit key), a container path -> a local
    one, and the directory the processes run in (outside the checkout)."""

    hosts: dict[str, str]
    mounts: dict[str, Path]
    workdir: Path
    replace: dict[str, str] = field(default_factory=dict)

    def localize(self, text: str) -> str:
        for old, new in self.replace.items():
            text = text.replace(old, new)
        for host, address in sorted(self.hosts.items(), key=lambda h: -len(h[0])):
            text = re.sub(rf"(?<=[@/]){re.escape(host)}:\d+", address, text)
        # one pass: a mount's local path is never read again as a container path
        paths = sorted(self.mounts, key=len, reverse=True)
        if paths:
            alternatives = "|".join(re.escape(p) for p in paths)
            pattern = rf"(?<![\w/])({alternatives})(?=/|$|\b)"
            text = re.sub(pattern, lambda m: str(self.mounts[m.group(1)]), text)
        return text


@dataclass
class Process:
    """One replica of a service, as a local process."""

    name: str
    argv: list[str]
    env: dict[str, str]
    ports: dict[str, int] = field(default_factory=dict)  # option -> the port it got
    proc: subprocess.Popen | None = None

    def start(self, workdir: Path, log: Path) -> Process:
        env = {**os.environ, **self.env, "OMP_NUM_THREADS": "1"}
        for name in ("REDIS_URL", "LORAPOOL_DB_URL", "RQ_REDIS_URL", "LORAPOOL_AUDIT_KEY"):
            if name not in self.env:
                env.pop(name, None)  # only what the manifest gives
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(
                self.argv, cwd=workdir, env=env, stdout=out, stderr=subprocess.STDOUT
            )
        return self

    def url(self, option: str = "--port") -> str:
        return f"http://127.0.0.1:{self.ports[option]}"

    def stop(self, timeout: float = 30) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def executable(name: str) -> list[str]:
    """This interpreter's ``lorapool`` / ``rq`` (a container's image has them on PATH)."""
    if name == "lorapool":
        return [sys.executable, "-c", "from lorapool.cli.main import main; main()"]
    if name == "rq":
        return [sys.executable, "-c", "from rq.cli import main; main()"]
    raise MissingReference(f"a container runs {name!r}, which lorapool does not install")


def localize_argv(argv: list[str], site: Site, free_port) -> tuple[list[str], dict[str, int]]:
    """The arguments with ``site``'s rules applied; listening ports made free ones."""
    out, ports = [], {}
    args = iter(argv)
    for arg in args:
        name, eq, value = arg.partition("=")
        if name in LISTEN_PORTS + LISTEN_HOSTS and not eq:
            next(args)
        if name in LISTEN_PORTS:
            ports[name] = free_port()
            out.append(f"{name}={ports[name]}")
        elif name in LISTEN_HOSTS:
            out.append(f"{name}=127.0.0.1")
        else:
            out.append(site.localize(arg))
    return out, ports


# --- Kubernetes -------------------------------------------------------------


def manifest_files(directory: Path = DEPLOY) -> list[Path]:
    """deploy/'s manifests, in every folder (setup/, pool/, autoscale/*, examples/): the
    YAML files but the kustomizations and the Helm chart's."""
    return sorted(
        p
        for p in directory.rglob("*.yaml")
        if p.name != "kustomization.yaml" and "helm" not in p.relative_to(directory).parts
    )


class Manifests:
    """deploy/'s resources (or ``resources``, a chart's rendering), by kind and name."""

    def __init__(self, directory: Path = DEPLOY, resources: list[dict] | None = None):
        self.resources = list(resources or [])
        if resources is None:
            for path in manifest_files(directory):
                self.resources += [d for d in yaml.safe_load_all(path.read_text()) if d]

    def of(self, kind: str) -> dict[str, dict]:
        return {r["metadata"]["name"]: r for r in self.resources if r["kind"] == kind}

    def get(self, kind: str, name: str, by: str) -> dict:
        found = self.of(kind).get(name)
        if found is None:
            raise MissingReference(f"{by} names the {kind} {name!r}, which deploy/ never defines")
        return found

    def secret(self, name: str, key: str, by: str) -> str:
        data = self.get("Secret", name, by).get("stringData", {})
        if key not in data:
            raise MissingReference(f"{by} names key {key!r} of Secret {name!r}, which it lacks")
        return data[key]

    def workloads(self) -> dict[str, dict]:
        """Deployments and Jobs: name -> the resource."""
        return {**self.of("Deployment"), **self.of("Job")}

    def check_references(self) -> None:
        """Every name a resource gives of another resolves, every variable it sets is
        read (raises MissingReference)."""
        for name, workload in self.workloads().items():
            env = self.container_env(workload, f"{workload['kind']} {name}")
            (container,) = workload["spec"]["template"]["spec"]["containers"]
            expanded = set()
            for arg in container.get("args", []):
                for ref in re.findall(r"\$\((\w+)\)", arg):
                    if ref not in env:
                        raise MissingReference(f"{workload['kind']} {name} expands $({ref}), unset")
                    expanded.add(ref)
            check_env_names(set(env) - expanded, f"{workload['kind']} {name}")
            for volume in workload["spec"]["template"]["spec"].get("volumes", []):
                by = f"{workload['kind']} {name}, volume {volume['name']}"
                if "secret" in volume:
                    self.get("Secret", volume["secret"]["secretName"], by)
                if "persistentVolumeClaim" in volume:
                    claim = volume["persistentVolumeClaim"]["claimName"]
                    self.get("PersistentVolumeClaim", claim, by)
        for name, scaled in self.of("ScaledObject").items():
            self.get("Deployment", scaled["spec"]["scaleTargetRef"]["name"], f"ScaledObject {name}")
            for trigger in scaled["spec"]["triggers"]:
                ref = trigger.get("authenticationRef", {}).get("name")
                if ref:
                    self.trigger_auth(ref, f"ScaledObject {name}")
        for name, hpa in self.of("HorizontalPodAutoscaler").items():
            self.get("Deployment", hpa["spec"]["scaleTargetRef"]["name"], f"HPA {name}")
        for name, service in self.of("Service").items():
            selector = service["spec"]["selector"]
            labels = [
                w["spec"]["template"]["metadata"]["labels"] for w in self.workloads().values()
            ]
            if not any(selector.items() <= lab.items() for lab in labels):
                raise MissingReference(f"Service {name} selects no workload of deploy/")

    def trigger_auth(self, name: str, by: str) -> dict[str, str]:
        """A TriggerAuthentication's parameters, from its Secrets."""
        auth = self.get("TriggerAuthentication", name, by)
        return {
            ref["parameter"]: self.secret(ref["name"], ref["key"], f"TriggerAuthentication {name}")
            for ref in auth["spec"]["secretTargetRef"]
        }

    def container_env(self, workload: dict, by: str) -> dict[str, str]:
        (container,) = workload["spec"]["template"]["spec"]["containers"]
        env = {}
        for item in container.get("env", []):
            if "value" in item:
                env[item["name"]] = str(item["value"])
            else:
                ref = item["valueFrom"]["secretKeyRef"]
                env[item["name"]] = self.secret(ref["name"], ref["key"], by)
        return env

    def processes(self, name: str, site: Site, free_port, replicas: int | None = None):
        """The replicas of workload ``name`` as processes (``replicas``: its manifest's)."""
        workload = self.workloads()[name]
        (container,) = workload["spec"]["template"]["spec"]["containers"]
        env = self.container_env(workload, f"{workload['kind']} {name}")
        argv = [*container["command"], *container.get("args", [])]
        argv = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in argv]
        count = workload["spec"].get("replicas", 1) if replicas is None else replicas
        made = []
        for i in range(count):
            args, ports = localize_argv(argv[1:], site, free_port)
            local_env = {k: site.localize(v) for k, v in env.items()}
            made.append(Process(f"{name}-{i}", executable(argv[0]) + args, local_env, ports))
        return made


# --- compose ----------------------------------------------------------------

_INTERPOLATION = re.compile(r"\$\{(\w+)(?::-([^}]*))?\}")


def interpolate(text: str, variables: dict[str, str]) -> str:
    """compose's ``${VAR}`` / ``${VAR:-default}``."""
    return _INTERPOLATION.sub(lambda m: variables.get(m.group(1)) or (m.group(2) or ""), text)


class Compose:
    """compose.yaml's services, interpolated with ``variables`` (its ``.env``)."""

    def __init__(self, variables: dict[str, str], path: Path = COMPOSE):
        self.doc = yaml.safe_load(interpolate(path.read_text(), variables))
        self.services = self.doc["services"]

    def argv(self, name: str) -> list[str]:
        command = self.services[name]["command"]
        return shlex.split(command) if isinstance(command, str) else list(command)

    def check_references(self) -> None:
        for name, service in self.services.items():
            for secret in service.get("secrets", []):
                if secret not in self.doc.get("secrets", {}):
                    raise MissingReference(f"service {name} names the secret {secret!r}")
            for dependency in service.get("depends_on", {}):
                if dependency not in self.services:
                    raise MissingReference(f"service {name} depends on {dependency!r}")
            if name not in ("redis", "postgres"):  # images of their own
                check_env_names(service.get("environment") or {}, f"service {name}")

    def processes(self, name: str, site: Site, free_port, replicas: int = 1) -> list[Process]:
        service = self.services[name]
        argv = self.argv(name)
        env = {k: str(v) for k, v in (service.get("environment") or {}).items()}
        made = []
        for i in range(replicas):
            args, ports = localize_argv(argv[1:], site, free_port)
            local_env = {k: site.localize(v) for k, v in env.items()}
            made.append(Process(f"{name}-{i}", executable(argv[0]) + args, local_env, ports))
        return made
