"""``lorapool audit verify / head / checkpoint``: checking the chain, exporting its head,
adding a signed checkpoint.

``verify`` walks the whole chain (a long job at millions of rows: it shows its
progress and saves its position, so ``--resume`` goes on where a stopped walk
was), or with ``--since-checkpoint`` only the rows after the newest checkpoint a
verify on this machine already passed; both check every signed checkpoint. What
was verified is kept in a state file (``--state``, default in the cache dir).
"""

from __future__ import annotations

import hashlib
import sys
import time
from pathlib import Path

import click
import orjson

from lorapool import settings
from lorapool.cli.audit_common import audit_key, engine_of, insecure_option, parse_age

SAVE_EVERY_ROWS = 50_000  # a full walk saves its position this often
PROGRESS_EVERY_S = 2.0


def _default_state(ctx: click.Context) -> Path:
    from sqlalchemy import make_url

    from lorapool.audit_db import default_url

    url = make_url(ctx.obj["db_url"] or default_url()).render_as_string(hide_password=True)
    digest = hashlib.sha256(f"{url}\n{ctx.obj['schema'] or ''}".encode()).hexdigest()[:16]
    return settings.cache_dir() / "audit-verify" / f"{digest}.json"


class State:
    """What verifies on this machine reached: the newest checkpoint passed and the
    position of a full walk under way."""

    def __init__(self, path: Path):
        self.path = path
        try:
            self.data = orjson.loads(path.read_bytes())
        except (OSError, orjson.JSONDecodeError):
            self.data = {}

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_bytes(orjson.dumps(self.data, option=orjson.OPT_INDENT_2))
        tmp.replace(self.path)

    @property
    def checkpoint_id(self) -> int | None:
        return (self.data.get("checkpoint") or {}).get("id")

    @property
    def walk(self) -> tuple[int, str] | None:
        walk = self.data.get("walk")
        return (walk["seq"], walk["row_hash"]) if walk else None


class _Progress:
    """Progress on stderr every few seconds, and the walk's position saved as it goes."""

    def __init__(self, state: State | None):
        self.state, self.start, self.shown, self.saved = state, time.monotonic(), 0.0, 0

    def __call__(self, walk, total: int) -> None:
        now = time.monotonic()
        if now - self.shown >= PROGRESS_EVERY_S and now - self.start >= PROGRESS_EVERY_S:
            rate = walk.num_rows / max(now - self.start, 1e-9)
            share = 100.0 * walk.num_rows / total if total else 100.0
            click.echo(
                f"verified {walk.num_rows:,} / {total:,} rows ({share:.0f}%), at row "
                f"{walk.seq:,}, {rate:,.0f} rows/s",
                err=True,
            )
            self.shown = now
        due = walk.num_rows - self.saved >= SAVE_EVERY_ROWS
        if self.state is not None and walk.first_bad is None and due:
            self.state.data["walk"] = {"seq": walk.seq, "row_hash": walk.row_hash}
            self.state.save()
            self.saved = walk.num_rows


def _read_head(head_file):
    from lorapool.audit_db.verify import Head, HeadError

    if head_file is None:
        return None
    try:
        return Head.from_json(head_file.read())
    except HeadError as exc:
        raise click.BadParameter(str(exc), param_hint="--head") from None


def run_verify(ctx, insecure, head_file=None, since=None, resume=None, state=None):
    """Verify as asked; exit 1 naming the failure, else return the report."""
    from lorapool.audit_db.checkpoints import CheckpointError
    from lorapool.audit_db.verify import verify_chain

    progress = _Progress(state if since is None else None)
    try:
        report = verify_chain(
            engine_of(ctx),
            key=audit_key(insecure),
            head=_read_head(head_file),
            since=since,
            resume=resume,
            progress=progress,
        )
    except CheckpointError as exc:
        raise click.BadParameter(str(exc), param_hint="--from-checkpoint") from None
    if not report.ok:
        click.echo(f"FAILED: {report.describe_failure()}", err=True)
        sys.exit(1)
    return report


def _since(state: State, since_checkpoint: bool, from_checkpoint: int | None) -> int | None:
    if from_checkpoint is not None:
        return from_checkpoint
    if since_checkpoint and state.checkpoint_id is None:
        click.echo("no checkpoint verified from here yet: verifying the whole chain", err=True)
    return state.checkpoint_id if since_checkpoint else None


def _remember(state: State, report) -> None:
    point = report.verified_checkpoint
    if point is not None:
        state.data["checkpoint"] = {"id": point.id, "seq": point.seq, "signature": point.signature}
    state.data.pop("walk", None)
    state.data["verified_at"] = time.time()
    state.save()


def _stale(report, max_age: float | None) -> str | None:
    if max_age is None:
        return None
    newest = report.newest_checkpoint_at
    if newest is None or time.time() - newest > max_age:
        when = "never" if newest is None else f"{(time.time() - newest) / 3600:.1f} h ago"
        return (
            f"the newest signed checkpoint was made {when}: the writer is not running, or "
            "rows (and their checkpoints) were cut from the tail"
        )
    return None


@click.command()
@click.option(
    "--head",
    "head_file",
    type=click.File("rb"),
    help="A head (`audit head`) or checkpoint file exported earlier: the chain must reach it.",
)
@click.option(
    "--since-checkpoint",
    is_flag=True,
    help="Walk only the rows after the newest checkpoint verified from here (every "
    "checkpoint is still checked).",
)
@click.option("--from-checkpoint", type=int, help="Walk only the rows after this checkpoint id.")
@click.option("--resume", is_flag=True, help="Go on with a full walk that was stopped.")
@click.option(
    "--max-checkpoint-age",
    help="Fail when the newest checkpoint is older than this (e.g. 36h): a writer "
    "checkpoints at least daily.",
)
@click.option("--state", "state_file", type=click.Path(dir_okay=False), help="State file.")
@insecure_option
@click.pass_context
def verify(ctx, head_file, since_checkpoint, from_checkpoint, resume, max_checkpoint_age,
           state_file, insecure):  # fmt: skip
    """Verify the hash chain; exit 1 and name the first row that does not match.

    Checks every signed checkpoint (a re-chained table or a moved key start fails
    here), the archive manifests, then walks the rows: all of them, or with
    --since-checkpoint those after the newest checkpoint verified from here.
    With --head, also fail when rows were cut from the tail or the chain was
    rewritten since that head was exported.
    """
    state = State(Path(state_file) if state_file else _default_state(ctx))
    since = _since(state, since_checkpoint, from_checkpoint)
    resume_at = state.walk if resume and since is None else None
    report = run_verify(ctx, insecure, head_file, since, resume_at, state)
    stale = _stale(report, parse_age(max_checkpoint_age, "--max-checkpoint-age"))
    if stale:
        click.echo(f"FAILED: {stale}", err=True)
        sys.exit(1)
    _remember(state, report)
    walked = f"rows {report.start_seq + 1}-{report.head_seq}" if report.num_rows else "no rows"
    click.echo(
        f"OK: {report.num_rows} rows, {report.num_adapters} adapters; "
        f"head seq={report.head_seq} hash={report.head_hash}; {walked} walked, "
        f"{report.num_checkpoints} checkpoints, {report.archived_rows} rows archived"
    )


@click.command()
@click.option("--output", "-o", type=click.File("wb"), default="-", help="Where to write it.")
@insecure_option
@click.pass_context
def head(ctx: click.Context, output, insecure: bool):
    """Verify the chain, then export its head (JSON) to keep outside the database.

    `audit verify --head FILE` later proves that no row up to it was cut or rewritten.
    """
    report = run_verify(ctx, insecure)
    output.write(report.head().to_json() + b"\n")


@click.command()
@click.option(
    "--adopt",
    is_flag=True,
    help="The chain has rows written without the key and no checkpoint: verify it as it "
    "is and make it the start of the keyed chain (check its contents first).",
)
@click.option("--output-dir", "-o", type=click.Path(file_okay=False), help="Also write it here.")
@click.pass_context
def checkpoint(ctx: click.Context, adopt: bool, output_dir: str | None):
    """Verify the chain from its last checkpoint and add a signed checkpoint at its head.

    The writer makes checkpoints itself (every K rows, at least daily); this one is
    for a cron job, before an export, or to adopt a chain written without the key.
    Needs the audit key and the writer's INSERT rights.
    """
    from lorapool.audit_db import checkpoint_now
    from lorapool.audit_db.checkpoints import export
    from lorapool.audit_db.guard import ChainTampered

    try:
        made = checkpoint_now(engine_of(ctx), audit_key(False), adopt=adopt)
    except ChainTampered as exc:
        click.echo(f"FAILED: {exc}", err=True)
        sys.exit(1)
    if made is None:
        click.echo("the chain is empty: no checkpoint")
        return
    if output_dir:
        export(made, output_dir)
    click.echo(f"checkpoint {made.id} at row {made.seq} (hash {made.row_hash})")


@click.command()
@click.option("--before", required=True, help="Archive every month before this one (YYYY-MM).")
@click.option(
    "--out",
    "folder",
    required=True,
    type=click.Path(file_okay=False),
    help="Folder for the archive files and their signed manifests (keep them on "
    "write-once storage).",
)
@click.pass_context
def archive(ctx: click.Context, before: str, folder: str):
    """Move the months before --before out of the database (PostgreSQL, as the owner).

    Each month's rows, verified, go to a gzipped JSON Lines file with a manifest
    signed with the audit key; the file is read back and verified, then the month's
    partition is detached and dropped. `audit verify` then starts from the end of the
    last archive; `audit verify-archive FILE` checks a file offline. The newest month
    always stays.
    """
    from lorapool.audit_db.archive import archive_before
    from lorapool.audit_db.archive_manifest import ArchiveError
    from lorapool.audit_db.partitions import parse_period

    try:
        month = parse_period(before)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--before") from None
    try:
        made = archive_before(engine_of(ctx), audit_key(False), month, folder, say=click.echo)
    except ArchiveError as exc:
        click.echo(f"FAILED: {exc}", err=True)
        sys.exit(1)
    click.echo(f"{len(made)} months archived to {folder}")


@click.command("verify-archive")
@click.argument("path", type=click.Path(exists=True, dir_okay=False))
@click.option(
    "--manifest", type=click.Path(exists=True, dir_okay=False), help="[default: PATH.manifest.json]"
)
def verify_archive(path: str, manifest: str | None):
    """Verify an archive file offline (no database): its signed manifest, its sha256,
    and every row's hash from the manifest's start to its end."""
    from lorapool.audit_db.archive import verify_file

    report = verify_file(path, audit_key(False), manifest)
    if not report.ok:
        bad = f" ({report.first_bad.describe()})" if report.first_bad else ""
        click.echo(f"FAILED: {report.problem}{bad}", err=True)
        sys.exit(1)
    m = report.manifest
    click.echo(
        f"OK: month {m.period}, rows {m.first_seq}-{m.last_seq} ({report.num_rows}), "
        f"ends with hash {m.end_hash}"
    )
