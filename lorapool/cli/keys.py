"""``lorapool keys add/list/revoke``: the gateway's API keys (stored hashed)."""

from __future__ import annotations

import click

from lorapool.cli.options import prefix_option, redis_option, shards_option


def _api_keys(redis_url, prefix, shards):
    from lorapool.producer import Producer
    from lorapool.producer.api_keys import ApiKeys

    producer = Producer(redis_url, prefix=prefix, shards=shards)
    return ApiKeys(producer.redis, producer.keys)


@click.group()
def keys():
    """API keys of the gateway: each names a tenant and a role."""


@keys.command("add")
@click.argument("tenant")
@click.option(
    "--role", type=click.Choice(["submit", "audit", "admin"]), default="submit", show_default=True
)
@click.option(
    "--adapter", "adapters", multiple=True, help="limit the tenant to this adapter (repeatable)"
)
@click.option("--rpm", type=click.IntRange(min=1), default=None, help="requests per minute")
@click.option(
    "--tpm", type=click.IntRange(min=1), default=None, help="tokens (max_tokens x n) per minute"
)
@click.option(
    "--all-tenants", is_flag=True, help="an audit key that reads every tenant's audit trail"
)
@click.option(
    "--weight",
    type=click.FloatRange(min=0, max=1000, min_open=True),
    default=None,
    help="the tenant's fair-share weight in workers beside other tenants (default 1)",
)
@redis_option
@prefix_option
@shards_option
def keys_add(tenant, role, adapters, rpm, tpm, all_tenants, weight, redis_url, prefix, shards):
    """Make a key for TENANT; the key is printed once (only its sha256 is stored)."""
    try:
        store = _api_keys(redis_url, prefix, shards)
        record, key = store.add(tenant, role, list(adapters) or None, rpm, tpm, all_tenants, weight)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"key id {record.id} for tenant {tenant!r}, role {role}:", err=True)
    click.echo(key)


_ID_WIDTH = 16


@keys.command("list")
@redis_option
@prefix_option
@shards_option
def keys_list(redis_url, prefix, shards):
    """Key ids, tenants, roles, rate limits and adapters (never the keys)."""
    records = _api_keys(redis_url, prefix, shards).list()
    click.echo(f"{'id':<{_ID_WIDTH}}  {'tenant':<24} {'role':<7} {'rpm':>6} {'tpm':>8}  adapters")
    for r in records:
        adapters = ", ".join(r.adapters) if r.adapters is not None else "all adapters"
        rpm, tpm = (str(limit or "-") for limit in (r.rpm, r.tpm))
        row = f"{r.id:<{_ID_WIDTH}}  {r.tenant:<24} {r.role:<7} {rpm:>6} {tpm:>8}"
        click.echo(f"{row}  {adapters}")


@keys.command("revoke")
@click.argument("key_id")
@redis_option
@prefix_option
@shards_option
def keys_revoke(key_id, redis_url, prefix, shards):
    """Revoke the key KEY_ID: the gateway refuses it from its next request."""
    if not _api_keys(redis_url, prefix, shards).revoke(key_id):
        raise click.ClickException(f"no key with id {key_id!r}")
    click.echo(f"revoked {key_id}")


@keys.command("webhook-secret")
@click.argument("tenant", required=False, default="")
@click.option("--rotate", is_flag=True, help="make a new secret; the old one stays valid a while")
@click.option(
    "--overlap",
    "overlap_s",
    type=click.FloatRange(min=0),
    default=24 * 3600,
    show_default=True,
    help="seconds the previous secret stays valid after --rotate",
)
@click.option("--drop-old", is_flag=True, help="end a rotation: only the newest secret stays")
@redis_option
@prefix_option
@shards_option
def keys_webhook_secret(tenant, rotate, overlap_s, drop_old, redis_url, prefix, shards):
    """Print TENANT's webhook signing secret (whsec_..., made if it has none): the
    Standard Webhooks secret its receivers verify deliveries with. Without TENANT: the
    secret of jobs submitted without one (--no-auth, Python producers)."""
    from lorapool.batch.webhook_secrets import WebhookSecrets
    from lorapool.producer import Producer
    from lorapool.records.api_key import check_tenant

    if tenant:
        try:
            check_tenant(tenant)
        except ValueError as exc:
            raise click.BadParameter(str(exc)) from None
    producer = Producer(redis_url, prefix=prefix, shards=shards)
    store = WebhookSecrets(producer.redis, producer.keys)
    if drop_old:
        click.echo(f"dropped {store.drop_old(tenant)} old secret(s)", err=True)
    secret = store.rotate(tenant, overlap_s) if rotate else store.current(tenant)
    if rotate:
        click.echo(f"rotated; the previous secret stays valid for {overlap_s:g}s", err=True)
    click.echo(secret)
