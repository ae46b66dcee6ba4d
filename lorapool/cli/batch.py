"""``lorapool batch``: OpenAI-style batch files over the pool.

    lorapool batch submit in.jsonl      -> the batch id (validated, then run by RQ jobs)
    lorapool batch status ID            -> its state and request counts
    lorapool batch cancel ID            -> stops it; finished lines stay in its output
    lorapool batch download ID -o out.jsonl [--errors err.jsonl]   (a progress bar
                                           until the batch ends)

The batch steps run on RQ workers of ``--queue`` started with the JSON serializer:
``rq worker lorapool-batch --serializer json --with-scheduler --worker-class
lorapool.batch.rq_worker.Worker``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import click
import orjson

from lorapool.cli.options import prefix_option, redis_option, shards_option
from lorapool.protocol import MAX_STOP

FINAL = {"completed", "failed", "expired", "cancelled"}

# batch files live in the pool's Redis now (lorapool/batch/files.py): the old option is
# accepted and ignored, so that scripts that pass it keep working
files_dir_option = click.option("--files-dir", hidden=True, expose_value=False)
queue_option = click.option(
    "--queue", default="lorapool-batch", show_default=True, help="RQ queue of the batch steps"
)


def _service(redis_url, prefix, queue, shards, max_stop=4):
    from lorapool.batch import BatchConfig, BatchService
    from lorapool.producer.client import connect

    config = BatchConfig(prefix=prefix, shards=shards, queue=queue, max_stop=max_stop)
    return BatchService(connect(redis_url), config)


def _options(command):
    for option in (queue_option, files_dir_option, prefix_option, shards_option, redis_option):
        command = option(command)
    return command


def _batch_errors(call):
    from lorapool.batch import BatchError

    try:
        return call()
    except BatchError as exc:
        raise click.ClickException(str(exc)) from None


@click.group()
def batch():
    """Batch files: submit, status, cancel, download."""


@batch.command()
@click.argument("path", type=click.Path(exists=True, dir_okay=False))
@click.option(
    "--endpoint",
    default="/v1/completions",
    show_default=True,
    type=click.Choice(["/v1/completions", "/v1/chat/completions"]),
    help="the batch's endpoint (every line's url must be it)",
)
@click.option(
    "--max-stop",
    default=4,
    show_default=True,
    type=click.IntRange(0, MAX_STOP),
    help="stop strings a line may name (as `lorapool serve --max-stop`; more fail the "
    "batch's validation)",
)
@_options
def submit(path, endpoint, max_stop, redis_url, prefix, queue, shards):
    """Upload PATH (JSONL, OpenAI's batch input lines) and start a batch over it."""
    service = _service(redis_url, prefix, queue, shards, max_stop)
    with open(path, "rb") as source:
        info = _batch_errors(lambda: service.upload(source, Path(path).name))
    created = _batch_errors(lambda: service.create(info["id"], endpoint))
    click.echo(created["id"])


@batch.command()
@click.argument("batch_id")
@click.option("--json", "as_json", is_flag=True, help="the whole Batch object as JSON")
@_options
def status(batch_id, as_json, redis_url, prefix, queue, shards):
    """The state of BATCH_ID."""
    found = _batch_errors(lambda: _service(redis_url, prefix, queue, shards).retrieve(batch_id))
    if as_json:
        click.echo(orjson.dumps(found, option=orjson.OPT_INDENT_2))
        return
    counts = found["request_counts"]
    click.echo(
        f"{found['id']} {found['status']}: {counts['completed']} completed, "
        f"{counts['failed']} failed of {counts['total']}"
    )
    for error in (found["errors"] or {}).get("data", []):
        click.echo(f"  {error['message']}")


@batch.command()
@click.argument("batch_id")
@_options
def cancel(batch_id, redis_url, prefix, queue, shards):
    """Cancel BATCH_ID: lines still to run are aborted, finished ones kept."""
    service = _service(redis_url, prefix, queue, shards)
    click.echo(_batch_errors(lambda: service.cancel(batch_id))["status"])


@batch.command()
@click.argument("batch_id")
@click.option("-o", "--output", type=click.Path(dir_okay=False), required=True)
@click.option("--errors", type=click.Path(dir_okay=False), help="where to write the error file")
@click.option("--timeout", type=float, default=None, help="seconds to wait for the batch")
@_options
def download(batch_id, output, errors, timeout, redis_url, prefix, queue, shards):
    """Wait for BATCH_ID to end (with a progress bar), then write its output file."""
    service = _service(redis_url, prefix, queue, shards)
    found = _wait(service, batch_id, timeout)
    if found["status"] == "failed":
        for error in (found["errors"] or {}).get("data", []):
            click.echo(error["message"], err=True)
        raise click.ClickException(f"batch {batch_id} failed")
    for file_id, path in ((found["output_file_id"], output), (found["error_file_id"], errors)):
        if path is not None:
            _write(service, file_id, path)
    counts = found["request_counts"]
    click.echo(f"{found['status']}: {counts['completed']} lines to {output}, "
               f"{counts['failed']} failed", err=True)  # fmt: skip


def _wait(service, batch_id: str, timeout: float | None) -> dict:
    from rich.progress import Progress

    deadline = None if timeout is None else time.monotonic() + timeout
    with Progress(transient=True, disable=not sys.stderr.isatty()) as progress:
        task = progress.add_task(batch_id, total=None)
        while (found := _batch_errors(lambda: service.retrieve(batch_id)))["status"] not in FINAL:
            counts = found["request_counts"]
            progress.update(task, total=counts["total"] or None,
                            completed=counts["completed"] + counts["failed"],
                            description=f"{batch_id} {found['status']}")  # fmt: skip
            if deadline is not None and time.monotonic() > deadline:
                raise click.ClickException(f"batch {batch_id} still {found['status']}")
            time.sleep(0.5)
    return found


def _write(service, file_id: str | None, path: str) -> None:
    with open(path, "wb") as out:
        if file_id is not None:
            for line in service.content(file_id):
                out.write(line)
