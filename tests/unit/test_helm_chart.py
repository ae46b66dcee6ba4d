"""deploy/helm/lorapool, rendered by ``helm template`` and checked offline.

Core resources validate strictly against kubernetes-validate's bundled schemas; KEDA's
and the Prometheus Operator's resources (CRDs, no bundled schema) get a structural
check. Every ``--option`` exists in ``--help``; every pod runs as the Dockerfile's
non-root user on a read-only root; Secrets are names of yours, with keys the example
holds; one autoscaler at most; every metrics port is scraped; what the values say
(storage classes, claims, replicas) is what renders. The rendering runs as processes in
tests/integration/test_deployment.py.
"""

import re
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from deployment import DEPLOY, KEDA_REDIS_STREAMS
from helm_chart import example_secrets, render, template

from lorapool.cli.main import cli
from lorapool.lifecycle.keys import WORKERS_GROUP, Keys

kubernetes_validate = pytest.importorskip("kubernetes_validate")

K8S_VERSION = "1.33.0"
CRDS = {"keda.sh/v1alpha1", "monitoring.coreos.com/v1"}
UID = int(
    re.search(r"useradd --uid (\d+)", (Path(__file__).parents[2] / "Dockerfile").read_text())[1]
)


def of(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def pods(docs: list[dict]) -> dict[str, dict]:
    """name -> pod template spec, of every Deployment and Job."""
    return {
        name: w["spec"]["template"]
        for kind in ("Deployment", "Job")
        for name, w in of(docs, kind).items()
    }


@pytest.fixture(scope="module")
def chart() -> list[dict]:
    return render()


@pytest.fixture(scope="module")
def monitored() -> list[dict]:
    return render("metrics.serviceMonitor.enabled=true")


def test_every_core_resource_validates_strictly(chart, monitored):
    kinds = set()
    for doc in chart + render("autoscaling.mode=hpa") + monitored:
        kinds.add(doc["kind"])
        if doc["apiVersion"] not in CRDS:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    want = {"Deployment", "Job", "Service", "PersistentVolumeClaim", "PodDisruptionBudget",
            "NetworkPolicy", "ScaledObject", "TriggerAuthentication",
            "HorizontalPodAutoscaler", "ServiceMonitor", "PodMonitor"}  # fmt: skip
    assert want <= kinds, want - kinds
    assert "Secret" not in kinds  # by reference only


def test_the_workloads_are_deploys_and_run_the_same_commands(chart):
    names = set(pods(chart))
    assert names == {f"lorapool-{n}" for n in (
        "worker", "gateway", "audit-writer", "rq-batch", "rq-callbacks", "exporter", "audit-setup"
    )}  # fmt: skip
    assert of(chart, "Deployment")["lorapool-gateway"]["spec"]["replicas"] == 2


@pytest.mark.parametrize("name", ["worker", "gateway", "audit-writer", "exporter", "audit-setup"])
def test_every_option_exists(chart, name):
    (container,) = pods(chart)[f"lorapool-{name}"]["spec"]["containers"]
    argv = [*container["command"], *container.get("args", [])]
    result = CliRunner().invoke(cli, [*argv[1 : 3 if name == "audit-setup" else 2], "--help"])
    assert result.exit_code == 0, result.output
    known = set(re.findall(r"--[a-z][a-z0-9-]*", result.output))
    given = {a.split("=")[0] for a in argv if a.startswith("--")}
    if name == "audit-setup":  # `audit --schema=... roles --apply`: the group's and the command's
        group = CliRunner().invoke(cli, ["audit", "--help"]).output
        known |= set(re.findall(r"--[a-z][a-z0-9-]*", group))
        result = CliRunner().invoke(cli, ["audit", "roles", "--help"])
        known |= set(re.findall(r"--[a-z][a-z0-9-]*", result.output))
    assert given <= known, given - known


def test_every_pod_runs_as_the_images_user_on_a_read_only_root(chart):
    for name, pod in pods(chart).items():
        security = pod["spec"]["securityContext"]
        assert security["runAsNonRoot"] is True and security["runAsUser"] == UID, name
        for container in pod["spec"]["containers"]:
            own = container["securityContext"]
            assert own["readOnlyRootFilesystem"] and not own["allowPrivilegeEscalation"], name
            assert own["capabilities"]["drop"] == ["ALL"], name


def test_secrets_are_yours_by_reference_with_the_examples_keys(chart, monitored):
    keys = {s["metadata"]["name"]: set(s["stringData"]) for s in example_secrets()}
    named = set()
    for name, pod in pods(chart).items():
        for container in pod["spec"]["containers"]:
            for item in container.get("env", []):
                ref = item.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["key"] in keys[ref["name"]], (name, ref)
                    named.add(ref["name"])
        for volume in pod["spec"].get("volumes", []):
            if "secret" in volume:
                named.add(volume["secret"]["secretName"])
    for auth in of(chart, "TriggerAuthentication").values():
        for ref in auth["spec"]["secretTargetRef"]:
            assert ref["key"] in keys[ref["name"]]
    for monitor in of(monitored, "ServiceMonitor").values():
        for endpoint in monitor["spec"]["endpoints"]:
            if "authorization" in endpoint:
                ref = endpoint["authorization"]["credentials"]
                assert ref["key"] in keys[ref["name"]], ref
                named.add(ref["name"])
    assert named == set(keys)
    renamed = render("secrets.redis=pool-redis")
    envs = [e for p in pods(renamed).values() for c in p["spec"]["containers"] for e in c["env"]]
    assert {"pool-redis"} == {e["valueFrom"]["secretKeyRef"]["name"] for e in envs
                              if e["name"] in ("REDIS_URL", "RQ_REDIS_URL")}  # fmt: skip


def test_one_autoscaler_at_most(chart):
    assert set(of(chart, "ScaledObject")) == {"lorapool-worker"}
    assert not of(chart, "HorizontalPodAutoscaler")
    assert "replicas" not in of(chart, "Deployment")["lorapool-worker"]["spec"]  # KEDA's
    (scaled,) = of(chart, "ScaledObject").values()
    for trigger in scaled["spec"]["triggers"]:
        meta = trigger["metadata"]
        assert trigger["type"] == "redis-streams" and set(meta) <= KEDA_REDIS_STREAMS
        assert meta["consumerGroup"] == WORKERS_GROUP
        assert all(isinstance(v, str) for v in meta.values())
        assert trigger["authenticationRef"]["name"] in of(chart, "TriggerAuthentication")
    streams = {t["metadata"]["stream"] for t in scaled["spec"]["triggers"]}
    assert streams == set(Keys("lorapool").streams)
    hpa = render("autoscaling.mode=hpa")
    assert not of(hpa, "ScaledObject") and set(of(hpa, "HorizontalPodAutoscaler")) == {
        "lorapool-worker"
    }
    plain = render("autoscaling.mode=none", "worker.replicas=3")
    assert not of(plain, "ScaledObject") and not of(plain, "HorizontalPodAutoscaler")
    assert of(plain, "Deployment")["lorapool-worker"]["spec"]["replicas"] == 3
    both = template("autoscaling.mode=keda+hpa", check=False)
    assert both.returncode != 0 and "autoscaling.mode" in both.stderr


def manifest(path: str, kind: str) -> dict:
    """deploy/'s resource of ``kind`` in ``path``."""
    (found,) = [d for d in yaml.safe_load_all((DEPLOY / path).read_text()) if d["kind"] == kind]
    return found


def test_the_autoscalers_scale_on_the_work_as_deploys_do(chart):
    """The chart's ScaledObject and HPA are deploy/autoscale's: the same triggers (pending
    and lag of both job streams), the same scalingModifiers formula, the HPA on
    lorapool_queue_work; their target follows worker.maxNumSeqs."""
    keda = manifest("autoscale/keda/autoscale-keda.yaml", "ScaledObject")
    (scaled,) = of(chart, "ScaledObject").values()
    assert scaled["spec"] == keda["spec"]
    auth = manifest("autoscale/keda/autoscale-keda.yaml", "TriggerAuthentication")
    assert [a["spec"] for a in of(chart, "TriggerAuthentication").values()] == [auth["spec"]]
    hpa = manifest("autoscale/hpa/autoscale-hpa.yaml", "HorizontalPodAutoscaler")
    (rendered,) = of(render("autoscaling.mode=hpa"), "HorizontalPodAutoscaler").values()
    assert rendered["spec"]["metrics"] == hpa["spec"]["metrics"]
    smaller = of(render("worker.maxNumSeqs=8"), "ScaledObject")["lorapool-worker"]["spec"]
    assert smaller["advanced"]["scalingModifiers"]["target"] == "8"
    counts = [m.get("lagCount") or m["pendingEntriesCount"] for m in
              (t["metadata"] for t in smaller["triggers"])]  # fmt: skip
    assert counts == ["8"] * 4
    (rendered,) = of(
        render("autoscaling.mode=hpa", "worker.maxNumSeqs=8"), "HorizontalPodAutoscaler"
    ).values()
    assert rendered["spec"]["metrics"][0]["external"]["target"]["averageValue"] == "8"


def test_probes_and_pre_stop(chart):
    (worker,) = pods(chart)["lorapool-worker"]["spec"]["containers"]
    drain = int(next(a for a in worker["args"] if a.startswith("--drain-timeout=")).split("=")[1])
    assert worker["lifecycle"]["preStop"]["exec"]["command"][-1] == f"kill -TERM 1; sleep {drain}"
    grace = pods(chart)["lorapool-worker"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > drain and {"startupProbe", "livenessProbe"} <= set(worker)
    (gateway,) = pods(chart)["lorapool-gateway"]["spec"]["containers"]
    assert gateway["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert gateway["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert "preStop" in gateway["lifecycle"]


def test_every_metrics_port_is_scraped(chart, monitored):
    """The worker's and the exporter's /metrics by annotations; the gateway's, which
    answers only an audit or admin key, by no annotation (a scrape without the key gets
    401) but by the ServiceMonitor, with the key of the Secret gatewayAuth names."""
    ports = {"lorapool-worker": 9300, "lorapool-exporter": 9400, "lorapool-gateway": 8000}
    for name, port in ports.items():
        annotations = pods(chart)[name]["metadata"].get("annotations", {})
        keyless = name != "lorapool-gateway"
        assert (annotations.get("prometheus.io/scrape") == "true") == keyless, name
        if keyless:
            assert annotations["prometheus.io/port"] == str(port), name
        (container,) = pods(chart)[name]["spec"]["containers"]
        assert port in [p["containerPort"] for p in container["ports"]], name
    (monitor,) = of(monitored, "ServiceMonitor").values()
    served = {p["name"] for s in of(monitored, "Service").values() for p in s["spec"]["ports"]}
    endpoints = {e["port"]: e for e in monitor["spec"]["endpoints"]}
    assert set(endpoints) == served  # the exporter's and the gateway's Services
    assert endpoints["http"]["authorization"] == {
        "type": "Bearer",
        "credentials": {"name": "lorapool-metrics", "key": "gateway-api-key"},
    }
    assert "authorization" not in endpoints["metrics"]
    renamed = render(
        "metrics.serviceMonitor.enabled=true",
        "metrics.serviceMonitor.gatewayAuth.secretName=scrape",
        "metrics.serviceMonitor.gatewayAuth.key=api-key",
    )
    (monitor,) = of(renamed, "ServiceMonitor").values()
    (gateway,) = [e for e in monitor["spec"]["endpoints"] if e["port"] == "http"]
    assert gateway["authorization"]["credentials"] == {"name": "scrape", "key": "api-key"}
    keyless = template(
        "metrics.serviceMonitor.enabled=true",
        "metrics.serviceMonitor.gatewayAuth.secretName=",
        check=False,
    )
    assert keyless.returncode != 0 and "gatewayAuth" in keyless.stderr, keyless.stderr
    (pod_monitor,) = of(monitored, "PodMonitor").values()
    assert pod_monitor["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == (
        "worker"
    )


def test_storage_classes_and_claims(chart):
    assert set(of(chart, "PersistentVolumeClaim")) == {"lorapool-models", "lorapool-adapters"}
    classed = render(
        "storage.models.storageClassName=fast-rox", "storage.adapters.existingClaim=mine"
    )
    claims = of(classed, "PersistentVolumeClaim")
    assert set(claims) == {"lorapool-models"}
    assert claims["lorapool-models"]["spec"]["storageClassName"] == "fast-rox"
    for name in ("lorapool-worker", "lorapool-gateway"):
        volumes = {v["name"]: v for v in pods(classed)[name]["spec"]["volumes"]}
        assert volumes["adapters"]["persistentVolumeClaim"]["claimName"] == "mine"


def test_disruption_budgets_and_network_policies_select_the_pods(chart):
    labels = {n: p["metadata"]["labels"] for n, p in pods(chart).items()}
    for budget in of(chart, "PodDisruptionBudget").values():
        wanted = budget["spec"]["selector"]["matchLabels"].items()
        selected = [n for n, lab in labels.items() if wanted <= lab.items()]
        assert selected == [budget["metadata"]["name"]]
    policies = of(chart, "NetworkPolicy").values()
    deny = [p for p in policies if "ingress" not in p["spec"]]
    assert len(deny) == 1
    assert all(deny[0]["spec"]["podSelector"]["matchLabels"].items() <= lab.items()
               for lab in labels.values())  # fmt: skip
    for name, port in {"lorapool-gateway": 8000, "lorapool-worker": 9300,
                       "lorapool-exporter": 9400}.items():  # fmt: skip
        allowed = [
            p
            for p in policies
            if "ingress" in p["spec"]
            and p["spec"]["podSelector"]["matchLabels"].items() <= labels[name].items()
        ]
        assert [r["port"] for p in allowed for i in p["spec"]["ingress"] for r in i["ports"]] == [
            port
        ], name
