"""``lorapool batch`` against the real pool: submit, status, download (and cancel of a
batch that is over), the files as the service reads them."""

from __future__ import annotations

import orjson
import pytest
from click.testing import CliRunner

from lorapool.cli.main import cli

pytestmark = pytest.mark.usefixtures("worker")


def test_submit_status_download(
    make_lines, tmp_path, redis_url, config, service, rq_worker, registry
):
    lines = make_lines(8, list(registry))
    source = tmp_path / "in.jsonl"
    source.write_bytes(b"".join(orjson.dumps(x) + b"\n" for x in lines))
    common = ["--redis-url", redis_url, "--prefix", config.prefix, "--queue", config.queue]
    runner = CliRunner()
    submitted = runner.invoke(cli, ["batch", "submit", str(source), *common])
    assert submitted.exit_code == 0, submitted.output
    batch_id = submitted.stdout.strip()
    assert batch_id.startswith("batch_")
    rq_worker()
    out, err = tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    got = runner.invoke(cli, ["batch", "download", batch_id, "-o", str(out), "--errors", str(err),
                              "--timeout", "120", *common])  # fmt: skip
    assert got.exit_code == 0, got.output
    outputs = [orjson.loads(x) for x in out.read_bytes().splitlines()]
    assert [o["custom_id"] for o in outputs] == [x["custom_id"] for x in lines]
    assert out.read_bytes() == b"".join(
        service.content(service.retrieve(batch_id)["output_file_id"])
    )
    assert err.read_bytes() == b""
    shown = runner.invoke(cli, ["batch", "status", batch_id, *common])
    assert shown.stdout.strip() == f"{batch_id} completed: 8 completed, 0 failed of 8"
    again = runner.invoke(cli, ["batch", "cancel", batch_id, *common])
    assert again.stdout.strip() == "completed"  # a batch that has ended stays as it ended
    missing = runner.invoke(cli, ["batch", "status", "batch_nope", *common])
    assert missing.exit_code == 1 and "no batch 'batch_nope'" in missing.output
