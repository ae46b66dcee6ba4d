"""``lorapool audit-writer``: consume ``{prefix}:audit`` into the audit database."""

from __future__ import annotations

import logging
import signal

import click

from lorapool.cli.audit import audit_key, db_options, insecure_option
from lorapool.cli.options import (
    config_from,
    count_option,
    seconds_option,
    shards_option,
    webhook_allow_option,
)
from lorapool.connection import LOOP_RETRIES, connect
from lorapool.lifecycle.keys import DEAD_MAX_LEN


def _install_signals(writer) -> None:
    def handle(signum, _frame):
        if writer.stopping:  # second signal: stop now
            raise KeyboardInterrupt
        logging.getLogger(__name__).info("signal %s: finishing the current batch", signum)
        writer.stop()

    signal.signal(signal.SIGTERM, handle)
    signal.signal(signal.SIGINT, handle)


@click.command("audit-writer")
@click.option("--redis-url", envvar="REDIS_URL", help="Redis holding {prefix}:audit.")
@click.option("--prefix", default="lorapool", show_default=True, help="Redis key prefix.")
@shards_option
@db_options
@click.option("--consumer", help="Consumer name [default: host-pid].")
@click.option("--batch-size", type=int, default=500, show_default=True)
@click.option(
    "--prefetch/--no-prefetch",
    default=True,
    show_default=True,
    help="Read the next batch before one is stored, and parse it while PostgreSQL inserts.",
)
@click.option(
    "--claim-idle-ms",
    type=int,
    default=60_000,
    show_default=True,
    help="Claim other consumers' entries pending this long.",
)
@count_option("--dead-max-len", DEAD_MAX_LEN, "Entries {prefix}:dead keeps (approximately).")
@count_option("--checkpoint-rows", 10_000, "A signed checkpoint at least every this many rows.")
@click.option(
    "--checkpoint-interval",
    "checkpoint_interval_s",
    type=click.FloatRange(min=1),
    default=86_400.0,
    show_default=True,
    help="And at least every this many seconds (idle or not).",
)
@click.option(
    "--checkpoint-dir",
    type=click.Path(file_okay=False),
    help="Also write each checkpoint here as a file (point it at write-once storage).",
)
@click.option("--migrate", "run_migrate", is_flag=True, help="Migrate the tables first.")
@click.option("--burst", is_flag=True, help="Exit once the stream is drained.")
@click.option(
    "--callback-queue",
    default="lorapool-callbacks",
    show_default=True,
    help="RQ queue of completion callbacks (jobs submitted with on_finish).",
)
@webhook_allow_option
@seconds_option(
    "--webhook-deadline",
    "webhook_deadline_s",
    10.0,
    "one webhook attempt may take in all (connect, send, read)",
    0.1,
    300,
)
@seconds_option(
    "--db-stall-timeout",
    "db_stall_timeout_s",
    10.0,
    "a write transaction may wait for the chain lock, run one statement or sit idle "
    "(PostgreSQL) before the server ends it and the batch is retried: a writer stopped "
    "mid-batch holds the others up at most this long",
    0.1,
    3600,
)
@count_option("--webhook-max-attempts", 8, "attempts before a delivery is dead-lettered")
@count_option("--webhook-tenant-concurrency", 2, "a tenant's webhook deliveries in flight at most")
@insecure_option
@click.option("--log-level", default="INFO", show_default=True)
def audit_writer(
    redis_url,
    db_url,
    schema,
    consumer,
    run_migrate,
    burst,
    callback_queue,
    webhook_allow,
    webhook_deadline_s,
    webhook_max_attempts,
    webhook_tenant_concurrency,
    insecure,
    log_level,
    **options,
):
    from lorapool.audit_db import AuditWriter, DatabaseConfig, WriterConfig, create_audit_engine

    logging.basicConfig(
        level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if not redis_url:
        raise click.UsageError("audit-writer needs Redis: pass --redis-url or set REDIS_URL")
    key = audit_key(insecure)
    config = config_from(
        WriterConfig,
        options,
        audit_key=key,
        insecure_no_key=insecure,
        migrate=run_migrate,
        **({"consumer": consumer} if consumer else {}),
    )
    name = f"lorapool audit-writer {config.consumer}"  # in pg_stat_activity
    engine = create_audit_engine(DatabaseConfig(url=db_url, schema=schema, application_name=name))
    from lorapool.batch.callbacks import Callbacks
    from lorapool.batch.deliveries import WebhookConfig
    from lorapool.lifecycle.keys import Keys

    try:
        webhooks = WebhookConfig(
            config.prefix, config.shards, callback_queue, tuple(webhook_allow),
            webhook_deadline_s, max_attempts=webhook_max_attempts,
            tenant_concurrency=webhook_tenant_concurrency,
        )  # fmt: skip
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None
    connection = connect(redis_url, LOOP_RETRIES)
    keys = Keys(config.prefix, config.shards)
    callbacks = Callbacks(connection, keys, callback_queue, webhooks)
    writer = AuditWriter(connection, engine, config, on_commit=callbacks)
    _install_signals(writer)
    from lorapool.audit_db.guard import ChainTampered
    from lorapool.audit_db.writer_config import own_the_collector

    own_the_collector()  # this process is the writer's

    try:
        stats = writer.run(burst=burst)
    except ChainTampered as exc:  # logged by the writer too
        click.echo(f"REFUSING TO WRITE: {exc}", err=True)
        raise SystemExit(3) from None
    click.echo(
        f"rows written {stats.rows_written}, duplicates {stats.duplicates}, "
        f"conflicts {stats.conflicts}, dead-lettered {stats.dead_lettered}, "
        f"entries {stats.entries}"
    )
