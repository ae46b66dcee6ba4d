"""The whole pipeline on embedded defaults: producer -> Redis -> 2 workers -> audit table.

Uses ``$REDIS_URL`` when set, else an embedded Redis; ``$LORAPOOL_DB_URL``
when set, else the default SQLite file; the audit key from the environment when
set, else a key file it makes once in the cache dir (``audit.key``). Works under
its own key prefix, which it clears first, so it never touches another deployment's keys.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time

import click
from rich.console import Console
from rich.table import Table

from lorapool.cli.demo_gateway import show_gateway
from lorapool.records.heartbeat import decode_heartbeats

PREFIX = "lorapool-demo"
# the demo's workers: names under which rendezvous hashing gives its three adapters homes
# on both (a test holds it), so what a newcomer sees first is the burst split between
# them; with "worker-a"/"worker-b" every adapter's home was worker-b, which served 6 of 8
WORKERS = ("worker-0", "worker-1")
JOBS = [  # (prompt, adapter name or None for the base model)
    ("My order arrived damaged. What should I do?", "support-bot"),
    ("Write a SQL query that counts users per country.", "sql-writer"),
    ("Write a short poem about the sea at night.", "poet"),
    ("Explain what a message queue is in two sentences.", None),
    ("How do I reset my password?", "support-bot"),
    ("Select the ten most recent orders in SQL.", "sql-writer"),
    ("A haiku about autumn leaves, please.", "poet"),
    ("What is the capital of France?", None),
]


def lorapool_cmd(*args: str) -> list[str]:
    """This interpreter's ``lorapool`` command (run it with ``cwd=child_cwd()``)."""
    return [sys.executable, "-m", "lorapool.cli.main", *args]


def child_cwd() -> str:
    """Children start outside the checkout: on sys.path, its root would shadow packages."""
    from lorapool.settings import cache_dir

    return str(cache_dir())


def ensure_audit_key(console: Console) -> None:
    """Give the demo's workers and writer an audit key: the environment's, else the cache's."""
    import os

    from lorapool import signing
    from lorapool.settings import cache_dir

    if signing.key_from_env() is not None:
        return
    path = cache_dir() / "audit.key"
    signing.write_key_file(path)
    os.environ[signing.KEY_FILE_ENV] = str(path)  # children inherit it
    console.print(f"audit key: {path} (audit records are signed with it)")


def run_demo(model: str, max_tokens: int, console: Console) -> None:
    # a SIGTERM ends the demo as Ctrl-C does, through its clean-up: its workers stop
    # (Python's default for SIGTERM exits at once, leaving them serving its prefix)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    with one_demo_at_a_time():
        pipeline(model, max_tokens, console)


@contextlib.contextmanager
def one_demo_at_a_time():
    """A lock in the cache dir: two demos share its embedded Redis and key prefix, and
    each would clear the other's jobs (its readers got JobLost)."""
    import fcntl

    from lorapool.settings import cache_dir

    cache_dir().mkdir(parents=True, exist_ok=True)
    with open(cache_dir() / "demo.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise click.ClickException(
                "another `lorapool demo` is running on this machine (it holds "
                f"{lock.name}); wait for it to end"
            ) from None
        yield


def pipeline(model: str, max_tokens: int, console: Console) -> None:
    from lorapool.connection import connect
    from lorapool.embedded import resolve_url
    from lorapool.producer import Producer

    ensure_audit_key(console)
    url = resolve_url()
    conn = connect(url)
    for key in conn.scan_iter(f"{PREFIX}:*"):
        conn.delete(key)
    producer = Producer(conn, prefix=PREFIX)
    register_adapters(producer, model, console)
    workers = start_workers(url, model, console)
    try:
        wait_ready(conn, producer.keys.workers, workers, console)
        started = time.time()
        handles = submit_jobs(producer, model, max_tokens, console)
        stream_one(handles[2], JOBS[2][0], console, workers)
        results = [h.result(timeout=900) for h in handles]
        show_gateway(url, PREFIX, console)  # the same pool over HTTP
    finally:  # never leave the workers running (a failed demo's kept serving the prefix)
        stop_children(workers)
    console.print(who_served_what(results))
    console.print(f"{len(results)} jobs served in {time.time() - started:.1f}s by 2 workers.")
    console.print(how_they_shared(results))
    write_audit(url, console)
    show_audit(results[2].request_id, started, console)


def register_adapters(producer, model: str, console: Console) -> None:
    from lorapool.cli.demo_adapters import ensure_demo_adapters
    from lorapool.settings import cache_dir

    for name, path in ensure_demo_adapters(model, cache_dir() / "demo-adapters").items():
        record = producer.registry.add(name, path)
        console.print(
            f"adapter [bold]{name}[/] registered: id {record.id}, sha256 {record.sha256[:12]}…"
        )


def submit_jobs(producer, model: str, max_tokens: int, console: Console):
    from transformers import AutoTokenizer

    from lorapool import RequestOutputKind, SamplingParams

    tokenizer = AutoTokenizer.from_pretrained(model)
    params = SamplingParams(
        temperature=0.0, max_tokens=max_tokens, output_kind=RequestOutputKind.DELTA
    )
    chats = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
        for prompt, _ in JOBS
    ]
    # one round trip per tenant, so the workers see the burst at once and each read takes
    # its fair share of it (submitted one by one, the first idle reader took most)
    handles = [None] * len(JOBS)
    for tenant, picks in (("acme", range(0, len(JOBS), 2)), ("globex", range(1, len(JOBS), 2))):
        made = producer.submit_many(
            [chats[i] for i in picks], params, [JOBS[i][1] for i in picks],
            metadata={"tenant": tenant},
        )  # fmt: skip
        for i, handle in zip(picks, made):
            handles[i] = handle
    adapters = {a for _, a in JOBS} - {None}
    console.print(
        f"submitted {len(handles)} jobs across {len(adapters)} adapters and the base model"
    )
    return handles


def start_workers(url: str, model: str, console: Console) -> list[subprocess.Popen]:
    from lorapool.settings import cache_dir

    logs = cache_dir() / "demo-logs"
    logs.mkdir(parents=True, exist_ok=True)
    console.print(f"starting 2 workers (each loads the model; logs in {logs})…")
    procs = []
    for name in WORKERS:
        log = open(logs / f"{name}.log", "w")  # noqa: SIM115 - the child owns it
        procs.append(
            subprocess.Popen(
                lorapool_cmd(
                    "worker",
                    "--model",
                    model,
                    "--enable-lora",
                    "--max-loras",
                    "4",
                    "--max-lora-rank",
                    "16",
                    "--redis-url",
                    url,
                    "--prefix",
                    PREFIX,
                    "--name",
                    name,
                ),
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=child_cwd(),
            )
        )
    return procs


def stop_children(procs: list[subprocess.Popen], timeout_s: float = 300) -> None:
    """SIGTERM (a worker drains, then exits) to every child still running; SIGKILL to
    those still running after ``timeout_s``."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def wait_ready(conn, workers_key: str, workers, console: Console, timeout=300) -> None:
    """Until each of the demo's workers has sent its first heartbeat (its model is
    loaded): by name, so that another process's record does not count (the records are
    keyed by each process's consumer, ``name#incarnation``; the name is in the record)."""
    deadline = time.monotonic() + timeout

    def names() -> set[str]:
        return {record.name for record in decode_heartbeats(conn.hgetall(workers_key)).values()}

    while not set(WORKERS) <= names():
        if any(w.poll() is not None for w in workers) or time.monotonic() > deadline:
            raise RuntimeError("a worker did not start; see its log")
        time.sleep(0.2)
    console.print(f"{len(workers)} workers ready")


def stream_one(handle, prompt: str, console: Console, workers) -> None:
    """Print one job's tokens as its chunks arrive; fail fast if every worker died."""
    console.rule(f"streaming {handle.request_id}")
    console.print(f"[bold]user:[/] {prompt}")
    console.print("[bold]assistant:[/] ", end="")
    last = -1
    while True:
        try:
            for chunk in handle.chunks(after=last, timeout=10):
                last = chunk.seq
                console.print(chunk.outputs[0].text, end="", highlight=False, soft_wrap=True)
                if chunk.finished:
                    lora = chunk.lora_request
                    adapter = "base model" if lora is None else lora.lora_name
                    console.print(f"\n[dim]({adapter}, served by {chunk.worker})[/]")
                    console.rule()
                    return
        except TimeoutError:
            if all(w.poll() is not None for w in workers):
                raise RuntimeError(
                    "the workers exited before the job finished; see their logs"
                ) from None


def who_served_what(results) -> Table:
    table = Table(title="who served what")
    for column in ("request", "adapter", "worker", "tokens", "finish", "completion"):
        table.add_column(column, overflow="fold" if column == "completion" else "ellipsis")
    for out in results:
        completion = out.outputs[0]
        table.add_row(
            out.request_id[:8],
            out.lora_request.name if out.lora_request else "—",
            out.worker or "?",
            str(len(completion.token_ids)),
            completion.finish_reason or "",
            completion.text[:60].replace("\n", " "),
        )
    return table


def how_they_shared(results) -> str:
    """One line per worker: how many jobs it served, and for which adapters."""
    served: dict[str, list[str]] = {}
    for out in results:
        name = out.lora_request.name if out.lora_request else "base"
        served.setdefault(out.worker or "?", []).append(name)
    lines = [
        f"{worker}: {len(names)} jobs ({', '.join(sorted(set(names)))})"
        for worker, names in sorted(served.items())
    ]
    lines.append(
        "[dim]each read takes the worker's fair share of the burst; a job whose adapter "
        "is loaded on (or homed at) the other worker goes there (adapter affinity)[/]"
    )
    return "\n".join(lines)


def write_audit(url: str, console: Console) -> None:
    console.print("audit writer: draining the audit stream into the database…")
    subprocess.run(
        lorapool_cmd(
            "audit-writer",
            "--redis-url",
            url,
            "--prefix",
            PREFIX,
            "--migrate",
            "--burst",
            "--log-level",
            "WARNING",
        ),
        check=True,
        cwd=child_cwd(),
    )


def show_audit(request_id: str, since: float, console: Console) -> None:
    from lorapool.audit_db import DatabaseConfig, create_audit_engine
    from lorapool.audit_db.queries import get_request, usage
    from lorapool.cli import audit_format as fmt

    engine = create_audit_engine(DatabaseConfig())
    console.print(
        fmt.usage_table(
            usage(engine, by="adapter", since=since), title="usage per adapter (this demo run)"
        )
    )
    for row in get_request(engine, request_id):
        console.print(fmt.record_table(row))
