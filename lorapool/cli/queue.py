"""Queue commands: ``worker``, ``submit``, ``abort``, ``status``, ``adapters``.

Only ``worker`` imports the engine (and torch); the others are producer-side.
"""

from __future__ import annotations

import sys

import click

from lorapool.cli.options import (
    config_from,
    count_option,
    finite_share,
    flag_option,
    grammar_limit_option,
    host_option,
    optional_option,
    prefix_option,
    redis_option,
    shards_option,
)
from lorapool.lifecycle.keys import DEAD_MAX_LEN
from lorapool.records.job import DEFAULT_MAX_N, DEFAULT_MAX_PROMPT_BYTES


def _producer(redis_url, prefix, shards=0):
    from lorapool.producer import Producer

    return Producer(redis_url, prefix=prefix, shards=shards)


@click.command()
@click.option("--model", required=True, help="model directory")
@click.option("--dtype", default="auto", show_default=True)
@click.option("--device", default="auto", show_default=True)
@click.option("--max-num-seqs", default=256, show_default=True)
@click.option("--max-num-batched-tokens", default=2048, show_default=True)
@click.option("--max-model-len", type=int, default=None)
@click.option("--enable-lora", is_flag=True)
@click.option("--max-loras", default=1, show_default=True)
@click.option("--max-lora-rank", default=16, show_default=True)
@optional_option("--max-cpu-loras", click.INT, "adapters kept in memory [default: max-loras]")
@click.option(
    "--adapter-root",
    "adapter_roots",
    multiple=True,
    type=click.Path(exists=True, file_okay=False),
    help="load adapters only from inside this directory (repeatable)",
)
@click.option(
    "--kv-cache-memory",
    type=int,
    default=None,
    help="bytes for the KV cache [default: 1 GiB on CPU, a share of free memory on GPU]",
)
@click.option(
    "--gpu-memory-utilization",
    type=click.FloatRange(0, 1, min_open=True),
    callback=lambda ctx, param, value: finite_share(param, value),
    default=0.9,
    show_default=True,
    help="share of the GPU's memory the engine may hold (as vLLM's); the KV cache gets "
    "what the weights and activations leave of it",
)
@click.option(
    "--enforce-eager/--no-enforce-eager",
    default=False,
    show_default=True,
    help="run every step eagerly; by default a CUDA worker captures CUDA graphs of decode "
    "steps (3.3x faster decode steps on an H200, benchmarks/RESULTS.md)",
)
@click.option("--enable-prefix-caching", is_flag=True)
@flag_option(
    "--async-output-proc",
    "detokenize and make a step's outputs during the next step's forward (vLLM V0's "
    "async output processor; all but first tokens and ends a step later); off by default",
)
@flag_option(
    "--async-scheduling",
    "schedule and queue the next step before a step's tokens are read back (vLLM V1's "
    "async scheduling; outputs a step later; not with --async-output-proc)",
)
@count_option(
    "--starvation-steps",
    8,  # SchedulerConfig.starvation_steps
    "engine steps a waiting request may be skipped (no adapter slot or no free KV blocks "
    "for it) while later ones run; then nothing behind it is admitted until it is: the "
    "bound of its wait (fewer: fairer, more: fuller batches)",
)
@click.option(
    "--tenant-fair-share/--no-tenant-fair-share",
    default=True,
    show_default=True,
    help="admit waiting requests by tenants' fair shares (a virtual token counter per "
    "tenant, weighted by its key's --weight); off: first come, first served",
)
@optional_option(
    "--tenant-prefill-cap",
    click.IntRange(min=1),
    "most prompt tokens a step of each tenant but the least served while two have work",
)
@count_option("--max-n", DEFAULT_MAX_N, "most completions per request")
@count_option("--max-prompt-bytes", DEFAULT_MAX_PROMPT_BYTES, "larger prompts are refused")
@count_option(
    "--result-ttl",
    24 * 3600,
    "seconds a finished job's outputs stay in Redis (a job may set its own)",
    "result_ttl_s",
)
@count_option("--dead-max-len", DEAD_MAX_LEN, "entries {prefix}:dead keeps (approximately)")
@count_option(
    "--log-grace",
    60,
    "seconds a finished request's chunk log stays for readers following it (the whole "
    "output stays, as one record, for --result-ttl)",
    "log_grace_s",
)
@count_option(
    "--max-chunk-rate",
    3000,  # WorkerConfig.max_chunk_rate
    "chunks a second the worker writes at most: above it, a request's tokens of several "
    "steps (at most 4) go out as one chunk; 0: every step's at once",
    least=0,
)
@click.option(
    "--name",
    default=None,
    help="worker name that status, logs, chunks and audit rows show (default: "
    "host-pid-random). Two live processes may share one (a restart while the old one is "
    "frozen): each is its own consumer, NAME#incarnation, fenced apart; the second "
    "warns at start, naming the first",
)
@click.option("--lease", "lease_s", default=10.0, show_default=True, help="lease seconds")
@click.option("--max-deliveries", default=3, show_default=True)
@click.option("--drain-timeout", default=30.0, show_default=True)
@click.option("--burst", is_flag=True, help="exit when the queue and the engine are empty")
@click.option(
    "--fair-share/--no-fair-share",
    default=True,
    show_default=True,
    help="take at most this worker's share of a burst per read (of the queued and running "
    "jobs over the live workers), so that a burst spreads over the pool",
)
@count_option(
    "--read-ahead",
    0,  # WorkerConfig.read_ahead
    "jobs a read may take beyond the engine's free slots, to wait there for the tenants' "
    "fair share to pick: a job behind another tenant's backlog is seen that much sooner",
    least=0,
)
@click.option(
    "--batch-share",
    default=0.5,
    show_default=True,
    type=click.FloatRange(0, 1, min_open=True),
    help="while interactive jobs come, batch jobs fill at most this share of the "
    "engine's sequences, so that interactive jobs arriving beside a batch find free slots",
)
@click.option(
    "--interactive-window",
    "interactive_window_s",
    default=60.0,
    show_default=True,
    type=click.FloatRange(min=0),
    help="seconds after the last interactive job during which --batch-share holds",
)
@click.option(
    "--affinity/--no-affinity",
    default=True,
    show_default=True,
    help="hand a job whose adapter is not loaded here to a live peer that has it loaded "
    "(or is its home) and is not much busier, so that adapters load less often",
)
@click.option("--metrics-port", type=int, default=None, help="serve Prometheus /metrics here")
@host_option("--metrics-host", old="--metrics-addr", help="address /metrics listens on")
@count_option("--metrics-max-adapters", 32, "series per adapter-labelled metric ('other' too)")
@flag_option("--metrics-vllm-names", "accepted for old command lines (vLLM's names are always on)")
@click.option(
    "--insecure-no-key",
    is_flag=True,
    envvar="LORAPOOL_AUDIT_INSECURE",
    help="run without an audit key: audit records go out unsigned",
)
@grammar_limit_option
@redis_option
@prefix_option
@shards_option
def worker(name, adapter_roots, drain_timeout, insecure_no_key, redis_url, metrics_host, **options):
    """Serve the request stream with one engine.

    Audit records are signed with $LORAPOOL_AUDIT_KEY (or the key in
    $LORAPOOL_AUDIT_KEY_FILE); without one the worker refuses to start.
    """
    from lorapool.connection import LOOP_RETRIES
    from lorapool.engine.config import EngineArgs
    from lorapool.producer.client import connect
    from lorapool.worker.config import WorkerConfig, default_name
    from lorapool.worker.serve import serve

    key_options = _audit_key(insecure_no_key)  # refuse before loading anything
    args = config_from(EngineArgs, options, adapter_roots=list(adapter_roots))
    config = config_from(
        WorkerConfig,
        options,
        name=name or default_name(),
        drain_timeout_s=drain_timeout,
        metrics_addr=metrics_host,
        **key_options,
    )
    from lorapool.worker.pool import ModelMismatchError

    try:
        serve(args, config, connect(redis_url, retries=LOOP_RETRIES))
    except ModelMismatchError as exc:
        raise click.ClickException(str(exc)) from None


def _audit_key(insecure: bool) -> dict:
    """WorkerConfig's audit key options, or a usage error saying how to give a key."""
    from lorapool import signing

    try:
        key = signing.key_from_env()
        signing.require_key(key, insecure)
    except signing.AuditKeyError as exc:
        raise click.UsageError(str(exc)) from None
    return {"audit_key": key, "insecure_no_key": insecure}


@click.command()
@click.argument("prompt")
@click.option("--adapter", default=None, help="registered adapter name")
@click.option("--max-tokens", default=64, show_default=True)
@click.option("--temperature", default=0.0, show_default=True)
@click.option("--seed", type=int, default=None)
@click.option("--request-id", default=None)
@click.option("--timeout", default=300.0, show_default=True)
@click.option(
    "--chat/--raw",
    default=None,
    help="send PROMPT as a user message under the model's chat template (the default for "
    "a chat model: one whose workers published a chat template), or as raw text",
)
@redis_option
@prefix_option
@shards_option
def submit(
    prompt, adapter, max_tokens, temperature, seed, request_id, timeout, chat, redis_url, prefix,
    shards,
):  # fmt: skip
    """Submit PROMPT and stream the completion to the terminal. A chat model gets it as
    one user message under its chat template (as /v1/chat/completions does); --raw
    sends the text as it is."""
    from lorapool.protocol import SamplingParams

    params = SamplingParams(
        max_tokens=max_tokens, temperature=temperature, seed=seed, output_kind="delta"
    )
    producer = _producer(redis_url, prefix, shards)
    if chat is None:
        chat = _chat_model(producer)
    body = {"messages": [{"role": "user", "content": prompt}]} if chat else prompt
    try:
        job = producer.submit(body, params, adapter, request_id)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    click.echo(f"[{job.request_id}]", err=True)
    final = None
    for final in job.stream(timeout=timeout):
        sys.stdout.write(final.outputs[0].text if final.outputs else "")
        sys.stdout.flush()
    if final is not None:
        reason = final.outputs[0].finish_reason if final.outputs else None
        click.echo(
            f"\n[{reason}; worker {final.worker}; adapter "
            f"{final.lora_request.name if final.lora_request else 'base'}"
            f"{'; error: ' + final.error if final.error else ''}]",
            err=True,
        )


def _chat_model(producer) -> bool:
    """Whether the pool's model has a chat template (its workers publish their
    tokenizer); unknown before a worker has started: raw, saying so."""
    import orjson

    raw = producer.redis.hget(producer.keys.tokenizer, "record")
    if raw is None:
        click.echo("[no worker has published the model's tokenizer yet: sent as raw text; "
                   "--chat applies its chat template]", err=True)  # fmt: skip
        return False
    return bool(orjson.loads(raw).get("chat_template"))


@click.command()
@click.argument("request_id")
@redis_option
@prefix_option
@shards_option
def abort(request_id, redis_url, prefix, shards):
    """Abort REQUEST_ID on whichever worker holds it."""
    _producer(redis_url, prefix, shards).abort(request_id)
    click.echo(f"abort requested for {request_id}")


@click.command()
@redis_option
@prefix_option
@shards_option
def trim(redis_url, prefix, shards):
    """Remove the job streams' entries every worker is done with (acked), never a
    queued or running one: the safe XTRIM (README, operator commands)."""
    from lorapool.lifecycle.trim import safe_trim

    producer = _producer(redis_url, prefix, shards)
    for stream, removed in safe_trim(producer.redis, producer.keys).items():
        click.echo(f"{stream}: {removed} entries removed")


@click.command()
@redis_option
@prefix_option
@shards_option
def status(redis_url, prefix, shards):
    """Workers, stream length, pending entries, lag and dead letters."""
    from rich.console import Console

    from lorapool.cli.queue_status import status_tables
    from lorapool.persistence import persistence_warning

    console = Console()
    producer = _producer(redis_url, prefix, shards)
    for table in status_tables(producer):
        console.print(table)
    warning = persistence_warning(producer.redis)
    if warning:
        console.print(f"[bold yellow]warning:[/] {warning}")


@click.group()
def adapters():
    """The adapter registry: add, list, remove."""


@adapters.command("add")
@click.argument("name")
@click.argument("path", type=click.Path(exists=True, file_okay=False))
@click.option("--id", "adapter_id", type=int, default=None, help="int id (default: next free)")
@click.option(
    "--adapter-root",
    "adapter_roots",
    multiple=True,
    help="refuse PATH outside this directory (repeatable; default: $LORAPOOL_ADAPTER_ROOTS)",
)
@redis_option
@prefix_option
@shards_option
def adapters_add(name, path, adapter_id, adapter_roots, redis_url, prefix, shards):
    """Register adapter NAME from the folder PATH (its weights' and config's hashes; again
    with the same folder pins the config of a record registered before config hashes)."""
    from lorapool.producer.registry import AdapterRegistry

    try:
        producer = _producer(redis_url, prefix, shards)
        registry = AdapterRegistry(producer.redis, producer.keys, list(adapter_roots) or None)
        record = registry.add(name, path, adapter_id)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(
        f"{record.name}: id {record.id}, rank {record.rank}, "
        f"sha256 {record.sha256[:16]}…, digest {record.digest[:16]}…, {record.path}"
    )


@adapters.command("list")
@redis_option
@prefix_option
@shards_option
def adapters_list(redis_url, prefix, shards):
    """List registered adapters (digest: of weights and config; '-': registered before
    config hashes, `adapters add` it again to pin its config)."""
    for r in _producer(redis_url, prefix, shards).registry.list():
        digest = (r.digest or "-")[:16]
        click.echo(
            f"{r.id:>4}  {r.name:<24} rank {r.rank:<4} {r.sha256[:16]}  {digest:<16}  {r.path}"
        )


@adapters.command("remove")
@click.argument("name")
@redis_option
@prefix_option
@shards_option
def adapters_remove(name, redis_url, prefix, shards):
    """Remove adapter NAME from the registry."""
    if not _producer(redis_url, prefix, shards).registry.remove(name):
        raise click.ClickException(f"no adapter named {name!r}")
    click.echo(f"removed {name}")
