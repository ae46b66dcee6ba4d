"""deploy/'s Kubernetes manifests, checked offline.

Core resources validate (strictly: no unknown fields) against the Kubernetes
schemas bundled by kubernetes-validate; KEDA's ScaledObject, a CRD without a
bundled schema, gets a structural check of the fields KEDA's redis-streams
scaler reads. Every ``--option`` a container passes must appear in
``lorapool <command> --help``, and the worker's drain must fit its grace period.
"""

import re
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from deployment import KEDA_REDIS_STREAMS

from lorapool.cli.main import cli
from lorapool.lifecycle.keys import DEFAULT_PREFIX, WORKERS_GROUP, Keys

kubernetes_validate = pytest.importorskip("kubernetes_validate")

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
K8S_VERSION = "1.33.0"


def resources() -> list[dict]:
    from deployment import manifest_files

    docs = []
    for path in manifest_files(DEPLOY):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def by_kind(kind: str) -> list[dict]:
    return [r for r in resources() if r["kind"] == kind]


def containers() -> list[dict]:
    return [c for d in by_kind("Deployment") for c in d["spec"]["template"]["spec"]["containers"]]


def options(container: dict) -> dict[str, str | None]:
    """``--name`` -> value (None for a flag) of a container's arguments."""
    found = {}
    for arg in container.get("args", []):
        name, _, value = arg.partition("=")
        if name.startswith("--"):
            found[name] = value or None
    return found


def worker() -> dict:
    return next(c for c in containers() if c["command"][1:] == ["worker"])


def test_the_manifests_are_there():
    kinds = {r["kind"] for r in resources()}
    assert {"Deployment", "Service", "ScaledObject", "HorizontalPodAutoscaler"} <= kinds
    commands = {tuple(c["command"]) for c in containers()}
    for command in ("worker", "serve", "audit-writer", "exporter"):
        assert ("lorapool", command) in commands


CRDS = {"ScaledObject", "TriggerAuthentication"}  # KEDA's: no bundled schema


@pytest.mark.parametrize("resource", [r for r in resources() if r["kind"] not in CRDS],
                         ids=lambda r: f"{r['kind']}/{r['metadata']['name']}")  # fmt: skip
def test_core_resources_validate_against_the_kubernetes_schemas(resource):
    kubernetes_validate.validate(resource, K8S_VERSION, strict=True)


def test_an_invalid_manifest_is_refused():
    """The check is real: a misspelt field of a Deployment fails it."""
    broken = by_kind("Deployment")[0]
    broken["spec"]["replica"] = broken["spec"].pop("replicas")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)


@pytest.mark.parametrize("container", containers(), ids=lambda c: c["name"])
def test_every_option_exists(container):
    from rq.cli import main as rq_cli

    program = {"lorapool": cli, "rq": rq_cli}[container["command"][0]]
    result = CliRunner().invoke(program, [*container["command"][1:], "--help"])
    assert result.exit_code == 0, result.output
    known = set(re.findall(r"--[a-z][a-z0-9-]*", result.output))
    assert set(options(container)) <= known, set(options(container)) - known


def test_the_worker_drains_within_its_grace_period():
    deployment = _worker_deployment()
    drain = float(options(worker())["--drain-timeout"])
    pre_stop = worker()["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[-1] == f"kill -TERM 1; sleep {drain:g}"  # first SIGTERM: drain
    assert deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > drain
    assert worker()["resources"]["limits"]["nvidia.com/gpu"] == 1


def _containers_of(deployment: dict) -> list[dict]:
    return deployment["spec"]["template"]["spec"]["containers"]


def test_keda_scales_the_worker_on_the_work_in_the_pool_by_its_batch_capacity():
    """Pending plus lag of both job streams (triggers in pending and in lag mode, one
    pair per stream), composed by scalingModifiers, over one worker's capacity: lag
    alone wanted no worker for a pool that keeps up (issue 49)."""
    (scaled,) = by_kind("ScaledObject")
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    spec = scaled["spec"]
    assert spec["scaleTargetRef"]["name"] == _worker_deployment()["metadata"]["name"]
    prefix = options(worker()).get("--prefix", DEFAULT_PREFIX)
    capacity = options(worker())["--max-num-seqs"]
    modes = {}
    for trigger in spec["triggers"]:
        meta = trigger["metadata"]
        assert trigger["type"] == "redis-streams" and set(meta) <= KEDA_REDIS_STREAMS
        assert meta["consumerGroup"] == WORKERS_GROUP
        assert all(isinstance(v, str) for v in meta.values())  # strings, for KEDA
        mode = "lag" if "lagCount" in meta else "pending"
        assert meta["lagCount" if mode == "lag" else "pendingEntriesCount"] == capacity
        modes[trigger["name"]] = (meta["stream"], mode)
    streams = list(Keys(prefix).streams)
    assert sorted(set(modes.values())) == sorted(
        (s, m) for s in streams for m in ("lag", "pending")
    )
    modifiers = spec["advanced"]["scalingModifiers"]
    assert set(modifiers["formula"].replace("+", " ").split()) == set(modes)  # their sum
    assert modifiers["target"] == capacity and modifiers["activationTarget"] == "0"
    assert modifiers.get("metricType", "AverageValue") == "AverageValue"


def test_the_hpa_reads_the_exporters_work_gauge():
    (hpa,) = by_kind("HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"]["name"] == _worker_deployment()["metadata"]["name"]
    (metric,) = hpa["spec"]["metrics"]
    assert metric["external"]["metric"]["name"] == "lorapool_queue_work"
    assert metric["external"]["target"]["averageValue"] == options(worker())["--max-num-seqs"]


def _worker_deployment() -> dict:
    return next(d for d in by_kind("Deployment") if worker() in _containers_of(d))


AUTOSCALERS = {"ScaledObject", "HorizontalPodAutoscaler"}


def _kustomizations() -> dict[str, list[dict]]:
    """Each kustomization's folder (relative to deploy/) -> the resources it applies."""
    found = {}
    for path in sorted(DEPLOY.rglob("kustomization.yaml")):
        listed = yaml.safe_load(path.read_text())["resources"]
        docs = [d for name in listed for d in yaml.safe_load_all((path.parent / name).read_text())]
        found[path.parent.relative_to(DEPLOY).as_posix()] = [d for d in docs if d]
    return found


def test_no_kustomization_applies_the_example_secrets_or_two_autoscalers():
    """`kubectl apply -k` of any folder never applies the example Secrets, and no folder
    holds both autoscalers; every manifest but the example is in exactly one folder."""
    from deployment import manifest_files

    kustomizations = _kustomizations()
    assert set(kustomizations) == {"setup", "pool", "autoscale/keda", "autoscale/hpa"}
    for folder, docs in kustomizations.items():
        kinds = [d["kind"] for d in docs]
        assert "Secret" not in kinds, folder
        assert len(AUTOSCALERS & set(kinds)) == (folder.startswith("autoscale/")), folder
    listed = sorted(
        (path.parent / name).resolve()
        for path in DEPLOY.rglob("kustomization.yaml")
        for name in yaml.safe_load(path.read_text())["resources"]
    )
    rest = [p for p in manifest_files(DEPLOY) if p.resolve() not in listed]
    assert [p.relative_to(DEPLOY).as_posix() for p in rest] == ["examples/secrets.example.yaml"]
    assert len(listed) == len(set(listed))
    readme = (DEPLOY / "README.md").read_text()
    for folder in kustomizations:
        assert f"kubectl apply -k deploy/{folder}" in readme or folder == "autoscale/hpa"
    assert "kubectl apply -f deploy/examples" not in readme


def test_the_kustomizations_build():
    import shutil
    import subprocess

    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("no kubectl")
    assert len(_kustomizations()) == 4  # setup, pool, autoscale/keda, autoscale/hpa
    for folder in _kustomizations():
        built = subprocess.run(
            [kubectl, "kustomize", str(DEPLOY / folder)], capture_output=True, text=True
        )
        assert built.returncode == 0, built.stderr


def test_the_gateway_mounts_the_adapters_it_registers():
    """storage.yaml says the gateway mounts the adapters and registers adapters in them."""
    gateway = next(c for c in containers() if c["command"][1:] == ["serve"])
    assert options(gateway)["--adapter-root"] == "/adapters"
    assert "--enable-adapter-admin" in options(gateway)
    mount = next(m for m in gateway["volumeMounts"] if m["mountPath"] == "/adapters")
    assert mount["readOnly"] is True
    (deployment,) = [d for d in by_kind("Deployment") if gateway in _containers_of(d)]
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert volumes[mount["name"]]["persistentVolumeClaim"]["claimName"] == "lorapool-adapters"


def test_every_rq_worker_runs_the_class_that_stops_promptly():
    """RQ's own classes can wait a minute at shutdown (lorapool/batch/rq_worker.py)."""
    rq = [c for c in containers() if c["command"][0] == "rq"]
    assert len(rq) == 2
    for container in rq:
        assert options(container)["--worker-class"] == "lorapool.batch.rq_worker.Worker"
    compose = yaml.safe_load((DEPLOY.parent / "compose.yaml").read_text())["services"]
    commands = [s["command"] for s in compose.values() if s.get("command", [""])[0] == "rq"]
    assert len(commands) == 2
    for command in commands:
        assert command[command.index("--worker-class") + 1] == "lorapool.batch.rq_worker.Worker"
