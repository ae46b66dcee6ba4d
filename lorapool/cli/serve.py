"""``lorapool serve``: the HTTP gateway (OpenAI-compatible and job APIs) under uvicorn."""

from __future__ import annotations

import click

from lorapool.cli.options import (
    config_from,
    count_option,
    grammar_limit_option,
    host_option,
    optional_option,
    prefix_option,
    redis_option,
    repeated_option,
    seconds_option,
    shards_option,
    webhook_allow_option,
)
from lorapool.protocol import MAX_STOP
from lorapool.records.job import DEFAULT_MAX_N, DEFAULT_MAX_PROMPT_BYTES


@click.command()
@host_option(help="address to listen on (0.0.0.0: every interface)")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535))
@count_option("--max-n", DEFAULT_MAX_N, "most completions per request")
@count_option("--max-prompt-bytes", DEFAULT_MAX_PROMPT_BYTES, "larger prompts get 413")
@click.option(
    "--max-stop",
    default=4,
    show_default=True,
    type=click.IntRange(0, MAX_STOP),
    help="stop strings a request may name (OpenAI's bound; more get 400 on stop)",
)
@count_option(
    "--redis-connections",
    64,
    "Redis connections the gateway opens at most; calls past them wait for one",
    least=2,
)
@optional_option(
    "--max-body-bytes",
    click.IntRange(min=1),
    "larger request bodies get 413 (default: room for the largest prompt)",
)
@click.option(
    "--result-timeout",
    default=600.0,
    show_default=True,
    help="seconds a non-streaming call waits for its result",
)
@click.option(
    "--queue-timeout",
    default=300.0,
    show_default=True,
    type=click.FloatRange(min=0.001),
    help="seconds an OpenAI call waits for a worker to take its job; then 503 no_worker "
    "and the job stays queued (scale from zero: the time a worker takes to start)",
)
@optional_option(
    "--max-backlog",
    click.IntRange(min=1),
    "submits get 429 while this many jobs wait for a worker (default: no bound)",
)
@click.option(
    "--auth/--no-auth",
    default=True,
    show_default=True,
    help="require an API key (lorapool keys add) on every /v1 route; --no-auth trusts "
    "the network and knows no tenants",
)
@repeated_option(
    "--cors-origin", "cors_origins", "a browser origin allowed to call the gateway, none by default"
)
@click.option(
    "--enable-adapter-admin",
    is_flag=True,
    help="serve /v1/load_lora_adapter and /v1/unload_lora_adapter (role admin)",
)
@repeated_option("--adapter-root", "adapter_roots", "register adapters only inside this directory")
@click.option(
    "--audit-db-url",
    default=None,
    help="serve /v1/audit/* from this database (a read-only role's URL)",
)
@click.option("--audit-db-schema", default=None, help="its PostgreSQL schema")
@optional_option(
    "--events-max-s",
    click.FloatRange(min=0.1),
    "end a job-events response after this long; EventSource reconnects (default: never)",
)
@click.option(
    "--tool-call-parser",
    type=click.Choice(["auto", "hermes", "llama3_json"]),
    default="auto",
    show_default=True,
    help="how tool_choice=auto replies are read for calls (auto: from the base model's name)",
)
@seconds_option(
    "--redis-timeout",
    "redis_timeout_s",
    2.0,
    "a Redis call may go unanswered before the request gets 503 (with one "
    "retry and a wait for a pooled connection: 503 within 3x this plus 0.2 s; at once "
    "once the gateway's 4-a-second ping has noticed)",
    0.05,
    3600,
)
@seconds_option(
    "--redis-outage",
    "redis_outage_s",
    30.0,
    "open streams and calls waiting for results wait for Redis to come back "
    "(then they resume exactly); past it they end with a 503 / an error event",
    0.5,
    3600,
)
@seconds_option(
    "--header-timeout",
    "header_timeout_s",
    10.0,
    "a connection has to send a request's headers (then 408 and closed: slowloris)",
    0.5,
    3600,
)
@click.option(
    "--body-timeout",
    "body_timeout_s",
    envvar="LORAPOOL_BODY_TIMEOUT",
    type=click.FloatRange(0.5, 3600),
    default=20.0,
    show_default=True,
    help="seconds a request's body has after its headers, plus one for every "
    "--body-min-rate bytes received (then 408 and closed: a body sent a byte at a time)",
)
@click.option(
    "--body-min-rate",
    envvar="LORAPOOL_BODY_MIN_RATE",
    type=click.IntRange(1),
    default=500,
    show_default=True,
    help="bytes a second that extend --body-timeout (Apache mod_reqtimeout's MinRate)",
)
@click.option(
    "--max-connections",
    envvar="LORAPOOL_MAX_CONNECTIONS",
    type=click.IntRange(0),
    default=4096,
    show_default=True,
    help="connections the gateway holds open in all (past it: 503 and closed; 0: no cap)",
)
@click.option(
    "--max-streams-per-tenant",
    envvar="LORAPOOL_MAX_STREAMS_PER_TENANT",
    type=click.IntRange(0),
    default=64,
    show_default=True,
    help="job-events streams, streamed completions, uploads and downloads one tenant may "
    "hold open "
    "(past it: 429 too_many_streams; 0: no cap)",
)
@click.option(
    "--max-streams",
    envvar="LORAPOOL_MAX_STREAMS",
    type=click.IntRange(0),
    default=1024,
    show_default=True,
    help="those of every tenant together on this gateway (past it: 503 too_many_streams; "
    "0: no cap)",
)
@click.option(
    "--tenant-audit-internals",
    envvar="LORAPOOL_TENANT_AUDIT_INTERNALS",
    is_flag=True,
    help="a tenant's audit key sees its rows' adapter paths, worker names and key ids "
    "(by default only admin keys and --all-tenants auditors do)",
)
@click.option(
    "--max-connections-per-client",
    "max_per_client",
    type=click.IntRange(0),
    default=256,
    show_default=True,
    help="connections one client address may hold open (past it: 429 and closed; 0: no "
    "cap, e.g. behind a proxy, whose address every connection has)",
)
@click.option(
    "--trust-proxy",
    is_flag=True,
    help="the gateway is reached only through a TLS-terminating proxy: believe its "
    "X-Forwarded-Proto/-For/-Host (client addresses, https) and make dashboard cookies "
    "Secure",
)
@optional_option(
    "--ssl-certfile", click.Path(exists=True, dir_okay=False), "serve TLS: certificate"
)
@optional_option("--ssl-keyfile", click.Path(exists=True, dir_okay=False), "serve TLS: its key")
@click.option(
    "--dashboard-session",
    "session_ttl_s",
    type=click.IntRange(60, 7 * 24 * 3600),
    default=3600,
    show_default=True,
    help="seconds a dashboard login lasts (the session cookie expires with it)",
)
@grammar_limit_option
@count_option(
    "--heavy-workers",
    2,
    "grammar compiles (sandbox processes) and large tokenizations run at once, off the "
    "event loop; more wait",
    least=1,
)
@count_option(
    "--turns-per-tenant",
    1,
    "requests of one API key the gateway looks up, reads and prepares at once (its "
    "others wait, in order, before that; paced while other keys are active; 0: none)",
    least=0,
)
@webhook_allow_option
@click.option("--log-level", default="info", show_default=True)
@redis_option
@prefix_option
@shards_option
def serve(
    host,
    port,
    result_timeout,
    queue_timeout,
    cors_origins,
    enable_adapter_admin,
    adapter_roots,
    webhook_allow,
    header_timeout_s,
    body_timeout_s,
    body_min_rate,
    max_connections,
    max_per_client,
    ssl_certfile,
    ssl_keyfile,
    log_level,
    redis_url,
    **options,
):
    """Serve the pool over HTTP: /v1/completions, /v1/chat/completions, /v1/models,
    /v1/jobs (asynchronous jobs and their events), /healthz, /readyz; OpenAPI docs at
    /docs.

    \b
    Environment it reads:
      REDIS_URL               --redis-url (unset: the shared embedded Redis)
      LORAPOOL_CACHE_DIR      where that embedded Redis lives (~/.cache/lorapool)
      LORAPOOL_SHARDS         --shards
      LORAPOOL_WEBHOOK_ALLOW  --webhook-allow
      LORAPOOL_AUDIT_KEY      the audit key POST /v1/audit/verify checks with,
      LORAPOOL_AUDIT_KEY_FILE   or a file holding it (no key: verify answers 503)
      LORAPOOL_ADAPTER_ROOTS  adapter roots without --adapter-root (os.pathsep)
      LORAPOOL_BATCH_QUEUE    the RQ queue batches go to (lorapool-batch)
      LORAPOOL_EGRESS_RESOLVE host=address pins for webhook hosts (comma-separated)
    """
    from lorapool.embedded import resolve_url
    from lorapool.gateway import GatewayConfig, create_app
    from lorapool.gateway.server import run

    config = config_from(
        GatewayConfig,
        options,
        redis_url=redis_url or resolve_url(),
        result_timeout_s=result_timeout,
        queue_timeout_s=queue_timeout,
        cors_origins=tuple(cors_origins),
        adapter_admin=enable_adapter_admin,
        adapter_roots=tuple(adapter_roots),
        webhook_allow=tuple(webhook_allow),
    )
    if (ssl_certfile is None) != (ssl_keyfile is None):
        raise click.UsageError("--ssl-certfile and --ssl-keyfile go together")
    tls = (ssl_certfile, ssl_keyfile) if ssl_certfile else None
    app = create_app(config)
    guards = {
        "header_timeout_s": header_timeout_s, "body_timeout_s": body_timeout_s,
        "body_min_rate": body_min_rate, "max_per_client": max_per_client,
        "max_connections": max_connections,
    }  # fmt: skip
    run(app, host, port, log_level, guards, config.trust_proxy, tls)
