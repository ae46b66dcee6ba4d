"""``lorapool serve --help`` names every environment variable the gateway reads (issue
49: LORAPOOL_AUDIT_KEY/_FILE were read, for POST /v1/audit/verify, and named nowhere).

The oracle is the code: the options' own ``envvar``s, every ``LORAPOOL_*`` name the
gateway's modules spell, and the constants of the helpers it calls that read the
environment (the audit key's, the egress resolver's, the adapter roots', the embedded
Redis's cache directory)."""

import re
from pathlib import Path

from click.testing import CliRunner

from lorapool import signing
from lorapool.cli.main import cli
from lorapool.cli.serve import serve
from lorapool.egress import RESOLVE_ENV
from lorapool.producer.registry import ROOTS_ENV

GATEWAY = Path(__file__).resolve().parents[2] / "gateway"


def read_by_the_gateway() -> set[str]:
    names = {p.envvar for p in serve.params if isinstance(p.envvar, str)}
    for path in GATEWAY.glob("*.py"):
        names |= set(re.findall(r"\bLORAPOOL_[A-Z_]*[A-Z]\b", path.read_text()))
    # signing.key_from_env (audit verify), egress.system_resolver (webhooks),
    # registry roots (adapter admin), settings.cache_dir (embedded.resolve_url)
    return names | {signing.KEY_ENV, signing.KEY_FILE_ENV, RESOLVE_ENV, ROOTS_ENV,
                    "LORAPOOL_CACHE_DIR", "REDIS_URL"}  # fmt: skip


def test_serve_help_names_every_variable_it_reads():
    result = CliRunner().invoke(cli, ["serve", "--help"], terminal_width=120)
    assert result.exit_code == 0, result.output
    missing = {name for name in read_by_the_gateway() if name not in result.output}
    assert not missing, f"serve --help does not name {sorted(missing)}"
