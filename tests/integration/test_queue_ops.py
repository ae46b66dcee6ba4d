"""Operations against real Redis: dead-lettering after max_deliveries, the queue CLI
(adapters, submit, status, abort) and the embedded Redis shared by processes; on a
standalone Redis and on a 3-master Redis Cluster (the pool in 3 shards), but for the
embedded Redis, which is a standalone one."""

import contextlib
import os
import re
import subprocess
import sys
import time

import orjson
import pytest
import redis
from click.testing import CliRunner
from pool_layout import entries, ids_on_shard, pending

from lorapool.cli.main import cli
from lorapool.embedded import EmbeddedServer
from lorapool.lifecycle.keys import WORKERS_GROUP
from lorapool.protocol import SamplingParams
from lorapool.records.audit import record_from_dict
from lorapool.worker import Worker, WorkerConfig
from lorapool.worker.serve import base_model_info

pytestmark = pytest.mark.integration
LAYOUTS = ("standalone", "cluster")
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


@pytest.fixture(scope="module")
def engine(model):
    from lorapool.engine.config import EngineArgs
    from lorapool.engine.llm_engine import LLMEngine

    return LLMEngine.from_engine_args(EngineArgs(model=model, max_num_seqs=8))


def fake_adapter(path, content=b"weights"):
    path.mkdir(parents=True)
    (path / "adapter_model.safetensors").write_bytes(content)
    return path


def worker_for(engine, conn, keys, model, **kw):
    pool = {"prefix": keys.prefix, "shards": keys.shards}
    config = WorkerConfig(**pool, **{"lease_s": 2, "name": "w-ops", **kw})
    worker = Worker(engine, conn, config, base_model_info(model))
    worker.ensure_group()
    return worker


def cli_run(pool_url, keys, *args):
    pool = ["--redis-url", pool_url, "--prefix", keys.prefix, "--shards", str(keys.shards)]
    result = CliRunner().invoke(cli, [*args, *pool])
    return result.exit_code, result.output


def test_max_deliveries_dead_letters(engine, conn, keys, producer, model, tmp_path):
    producer.registry.add("sql", fake_adapter(tmp_path / "sql"), adapter_id=4)
    handle = producer.submit("hello", GREEDY, lora_request="sql")
    worker = worker_for(engine, conn, keys, model, lease_s=0.2, max_deliveries=1, burst=True)
    stream = keys.for_request(handle.request_id).requests
    conn.xreadgroup(WORKERS_GROUP, "ghost", {stream: ">"})  # delivery 1
    time.sleep(0.25)  # the ghost never renews: past the lease, delivery 2 is one too many
    worker.run()
    final = handle.result(timeout=5)
    assert final.outputs[0].finish_reason == "error" and "max_deliveries=1" in final.error
    assert final.lora_request.name == "sql" and final.worker == "w-ops"
    dead = entries(conn, keys, "dead")
    assert len(dead) == 1 and b"delivered 2 times" in dead[0][1][b"reason"]
    ((_, fields),) = entries(conn, keys, "audit")
    record = record_from_dict(orjson.loads(fields[b"data"]))
    assert record.request_id == handle.request_id and "max_deliveries" in record.error
    assert record.outputs[0].finish_reason == "error" and record.adapter.id == 4
    assert pending(conn, keys) == 0
    assert not engine.has_unfinished_requests()


def test_cli_adapters(pool_url, keys, tmp_path):
    first, other = fake_adapter(tmp_path / "a"), fake_adapter(tmp_path / "b", b"other")
    code, out = cli_run(pool_url, keys, "adapters", "add", "a", str(first), "--id", "3")
    assert code == 0 and "a: id 3" in out
    assert cli_run(pool_url, keys, "adapters", "add", "a", str(first))[0] == 0  # same
    code, out = cli_run(pool_url, keys, "adapters", "add", "b", str(other), "--id", "3")
    assert code == 1 and "adapter id 3 is already used by adapter 'a'" in out
    code, out = cli_run(pool_url, keys, "adapters", "add", "a", str(other))
    assert code == 1 and "already registered with other weights" in out
    assert cli_run(pool_url, keys, "adapters", "add", "b", str(other))[1].startswith("b: id 4")
    code, out = cli_run(pool_url, keys, "adapters", "list")
    lines = out.splitlines()
    assert code == 0 and len(lines) == 2 and " a " in lines[0] and " b " in lines[1]
    assert cli_run(pool_url, keys, "adapters", "remove", "a") == (0, "removed a\n")
    code, out = cli_run(pool_url, keys, "adapters", "remove", "a")
    assert code == 1 and "no adapter named 'a'" in out
    assert "a" not in cli_run(pool_url, keys, "adapters", "list")[1].split()


def test_cli_submit_streams(engine, conn, pool_url, keys, producer, model, tmp_path):
    cmd = [
        sys.executable,
        "-c",
        "from lorapool.cli.main import main; main()",
        "submit",
        "hello world",
        "--max-tokens",
        "12",
        "--request-id",
        "cli-1",
        "--redis-url",
        pool_url,
        "--prefix",
        keys.prefix,
        "--shards",
        str(keys.shards),
    ]
    proc = subprocess.Popen(
        cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 30
    while not conn.exists(producer.keys.job("cli-1")):
        assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read()
        time.sleep(0.05)
    worker_for(engine, conn, keys, model, burst=True).run()
    out, err = proc.communicate(timeout=30)
    final = producer.handle("cli-1").result(timeout=5)
    assert proc.returncode == 0 and out == final.outputs[0].text
    assert "[cli-1]" in err and "[length; worker w-ops; adapter base]" in err


def test_cli_status_and_abort(engine, conn, pool_url, keys, producer, model):
    # both on one shard: the stream's row counts them together (any ids on standalone)
    running, waiting = ids_on_shard(keys, 0, 2, "status")
    handle = producer.submit(
        "hello", SamplingParams(temperature=0, max_tokens=200, ignore_eos=True), None, running
    )
    producer.submit("waiting one", GREEDY, request_id=waiting)
    worker = worker_for(engine, conn, keys, model, max_deliveries=2)
    worker.engine.args.max_num_seqs, saved = 1, worker.engine.args.max_num_seqs
    try:
        for _ in range(3):
            worker.run_once()
        worker.heartbeat()
        code, out = cli_run(pool_url, keys, "status")
        assert code == 0 and "w-ops" in out and "cpu" in out
        row = next(line for line in out.splitlines() if keys.on(0).requests in line)
        cells = [c.strip() for c in re.split(r"[│|┃]", row) if c.strip()]
        # Redis reports a group's lag from 7.0 on; before, the table shows "-".
        lag = "1" if int(conn.info()["redis_version"].split(".")[0]) >= 7 else "-"
        assert cells[1:] == ["2", "1", lag, "0"]  # length, pending, lag, dead letters
        code, out = cli_run(pool_url, keys, "abort", handle.request_id)
        assert code == 0 and f"abort requested for {handle.request_id}" in out
        # the abort lands a step or two later (the flag is seen with a chunk's round trip)
        for _ in range(50):
            if handle.request_id not in worker.held:
                break
            worker.run_once()
    finally:
        worker.engine.args.max_num_seqs = saved
    final = handle.result(timeout=5)
    assert final.outputs[0].finish_reason == "abort" and len(final.outputs[0].token_ids) < 10
    worker.config.burst = True
    worker.run()


SHARED = """
import os, subprocess, sys, redis
from lorapool.embedded import resolve_url
url = resolve_url()
r = redis.Redis.from_url(url)
r.incr("starts")
print(r.info("server")["process_id"], flush=True)
if sys.argv[1] == "parent":  # a child sees the server through $REDIS_URL
    child = subprocess.run([sys.executable, "-c", sys.argv[2], "child", ""], check=True,
                           capture_output=True, text=True)
    print(child.stdout.strip(), os.environ["REDIS_URL"] == url, flush=True)
if sys.argv[1] != "child":
    r.blpop("go", timeout=20)
"""


@pytest.mark.layouts("standalone")  # the embedded Redis is a standalone one
def test_embedded_redis_is_shared(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    env["LORAPOOL_CACHE_DIR"] = str(tmp_path)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", SHARED, role, SHARED],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )
        for role in ("parent", "alone", "alone")
    ]  # started at the same moment
    pids = [p.stdout.readline().split() for p in procs]
    parent_line = procs[0].stdout.readline().split()
    r = redis.Redis.from_url(resolve_in(tmp_path))
    try:
        assert int(r.get("starts")) == 4 and r.info("server")["process_id"] == int(pids[0][0])
        r.rpush("go", *[1] * 3)
        assert [p.wait(30) for p in procs] == [0, 0, 0]
        assert {pid[0] for pid in pids} == {parent_line[0]} and parent_line[1] == "True"
    finally:
        _shutdown(r)


def _shutdown(r) -> None:
    """Stop the server if the last client did not (it skips it when they race)."""
    with contextlib.suppress(redis.ConnectionError):
        r.shutdown(nosave=True)


def resolve_in(cache_dir) -> str:
    """The unix URL of the embedded server of ``cache_dir``."""
    return EmbeddedServer(cache_dir / "redis").url


def test_cli_status_shows_the_loaded_adapters_and_never_a_negative_age(conn, pool_url, keys):
    """A worker's row names the adapters in its device slots (its record's ``loaded``),
    not only those of the requests it runs; a record written by a clock a little ahead
    (another host's) reads "0.0s ago", never a negative age ("-0.0s ago", "-4.7s ago")."""
    from lorapool.records.heartbeat import Heartbeat
    from lorapool.worker.pool import send_heartbeat

    ahead = time.time() + 5  # another host's clock, 5 s ahead
    record = Heartbeat(name="w-seen", consumer="w-seen#1", device="cpu", updated=ahead,
                       adapters=["sql"], loaded=["sql", "chat-v2"])  # fmt: skip
    send_heartbeat(conn, keys, record, 30)
    pool = ["--redis-url", pool_url, "--prefix", keys.prefix, "--shards", str(keys.shards)]
    result = CliRunner().invoke(cli, ["status", *pool], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    row = next(line for line in result.output.splitlines() if "w-seen" in line)
    assert "chat-v2" in row and "sql" in row
    assert "0.0s ago" in row and "-" not in row.split("chat-v2")[1]


def test_cli_submit_applies_the_chat_template_of_a_chat_model_unless_raw(conn, pool_url, keys):
    """``lorapool submit`` sends a chat model's prompt as one user message (the worker
    applies the model's chat template, as /v1/chat/completions does); ``--raw`` the text;
    before any worker published the tokenizer: raw, saying so. The oracle: the job
    entries in the stream."""
    import orjson

    pool = ["--redis-url", pool_url, "--prefix", keys.prefix, "--shards", str(keys.shards)]

    def submitted(rid: str, *flags: str) -> tuple[dict, str]:
        args = ["submit", "Hi there", "--request-id", rid, "--timeout", "0.1", *flags, *pool]
        output = CliRunner().invoke(cli, args).output
        stream = keys.for_request(rid).requests
        (job,) = [
            orjson.loads(f[b"data"]) for _, f in conn.xrange(stream) if rid.encode() in f[b"data"]
        ]
        return job, output

    job, said = submitted("chat-none")
    assert job.get("prompt") == "Hi there" and not job.get("messages")
    assert "raw text" in said
    record = {
        "tokenizer": "{}",
        "chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}",
    }
    conn.hset(keys.tokenizer, mapping={"sha256": "x", "record": orjson.dumps(record)})
    job, _ = submitted("chat-yes")
    assert job["messages"] == [{"role": "user", "content": "Hi there"}] and not job.get("prompt")
    job, _ = submitted("chat-raw", "--raw")
    assert job.get("prompt") == "Hi there" and not job.get("messages")
    conn.hset(keys.tokenizer, mapping={"record": orjson.dumps({**record, "chat_template": None})})
    job, _ = submitted("base-model")  # a model without a chat template: raw
    assert job.get("prompt") == "Hi there" and not job.get("messages")
