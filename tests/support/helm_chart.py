"""deploy/helm/lorapool rendered by ``helm template``, for the chart's tests.

Without a helm binary the tests skip, unless LORAPOOL_TEST_REQUIRE_HELM is set (CI sets
it: .ci/run installs helm with .ci/helm), where they fail instead.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "lorapool"
EXAMPLE_SECRETS = ROOT / "deploy" / "examples" / "secrets.example.yaml"
RELEASE = "lorapool"


def helm() -> str:
    found = shutil.which("helm")
    if found is None:
        if os.environ.get("LORAPOOL_TEST_REQUIRE_HELM"):
            pytest.fail("LORAPOOL_TEST_REQUIRE_HELM is set and no helm is on PATH (.ci/helm)")
        pytest.skip("no helm binary (.ci/helm installs one)")
    return found


def template(*sets: str, check: bool = True) -> subprocess.CompletedProcess:
    """``helm template lorapool deploy/helm/lorapool --set ...`` (each of ``sets``)."""
    argv = [helm(), "template", RELEASE, str(CHART), "--namespace", "lorapool"]
    for item in sets:
        argv += ["--set", item]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    if check:
        assert done.returncode == 0, done.stderr
    return done


def render(*sets: str) -> list[dict]:
    """The chart's resources with ``sets`` applied."""
    return [d for d in yaml.safe_load_all(template(*sets).stdout) if d]


def example_secrets() -> list[dict]:
    return [d for d in yaml.safe_load_all(EXAMPLE_SECRETS.read_text()) if d]
