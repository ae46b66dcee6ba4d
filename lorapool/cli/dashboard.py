"""``lorapool dashboard``: the pool's dashboard page and /metrics, without the gateway."""

from __future__ import annotations

import click

from lorapool.cli.options import host_option, prefix_option, redis_option, shards_option


@click.command()
@host_option(help="address to listen on; it has no keys: keep it local")
@click.option("--port", default=8050, show_default=True, type=click.IntRange(0, 65535))
@click.option("--audit-db-url", default=None, help="show the latest audit rows from this database")
@click.option("--audit-db-schema", default=None, help="its PostgreSQL schema")
@click.option("--log-level", default="warning", show_default=True)
@redis_option
@prefix_option
@shards_option
def dashboard(host, port, audit_db_url, audit_db_schema, log_level, redis_url, prefix, shards):
    """Serve a read-only page of the pool on /dashboard (workers, queue, hottest adapters,
    latest audit rows, dead letters; it reloads itself) and its gauges on /metrics. A
    gateway (lorapool serve) serves the same page behind its API keys."""
    from lorapool.embedded import resolve_url
    from lorapool.gateway import GatewayConfig
    from lorapool.gateway.dashboard import create_dashboard_app
    from lorapool.gateway.server import run

    config = GatewayConfig(
        redis_url=redis_url or resolve_url(),
        prefix=prefix,
        shards=shards,
        auth=False,
        audit_db_url=audit_db_url,
        audit_db_schema=audit_db_schema,
    )
    click.echo(f"dashboard of {prefix} on http://{host}:{port}/dashboard")
    run(create_dashboard_app(config), host, port, log_level)
