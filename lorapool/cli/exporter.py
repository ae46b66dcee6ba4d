"""``lorapool exporter``: the pool's gauges on ``/metrics`` for Prometheus (torch-free)."""

from __future__ import annotations

import logging
import threading

import click

from lorapool.cli.options import host_option, shards_option
from lorapool.lifecycle.keys import DEFAULT_PREFIX


@click.command()
@click.option("--redis-url", envvar="REDIS_URL", help="the pool's Redis (required)")
@click.option("--prefix", default=DEFAULT_PREFIX, show_default=True, help="key prefix")
@shards_option
@click.option("--port", default=9400, show_default=True, type=click.IntRange(0, 65535))
@host_option(old="--addr", help="address to listen on (0.0.0.0: every interface)")
def exporter(redis_url, prefix, shards, port, host):
    """Serve the pool's gauges (queue length, pending, lag, dead letters, live workers,
    audit backlog), read from Redis on each scrape."""
    from prometheus_client import CollectorRegistry, start_http_server

    from lorapool.connection import connect
    from lorapool.lifecycle.keys import Keys
    from lorapool.lifecycle.pool_metrics import PoolCollector

    if not redis_url:
        raise click.UsageError("the exporter needs Redis: pass --redis-url or set REDIS_URL")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    registry = CollectorRegistry()
    registry.register(PoolCollector(connect(redis_url, retries=1), Keys(prefix, shards)))
    server, _ = start_http_server(port, host, registry)
    click.echo(f"serving {prefix}'s pool metrics on http://{host}:{server.server_port}/metrics")
    threading.Event().wait()  # until SIGTERM / SIGINT ends the process
