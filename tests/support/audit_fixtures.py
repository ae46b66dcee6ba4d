"""Fixtures and helpers for the audit trail tests (a pytest plugin).

Use with ``pytest_plugins = ["audit_fixtures"]``. ``audit_target`` is
parametrized over SQLite (a file under tmp) and PostgreSQL
(``$LORAPOOL_TEST_PG_URL``, skipped when unset): each test gets migrated
tables in a schema of its own, dropped afterwards. ``audit_redis`` gives the
pool layout's client (tests/integration/conftest.py) and a fresh key prefix
whose keys are deleted afterwards.
"""

from __future__ import annotations

import contextlib
import os
import random
import socket
import threading
import time
import uuid
from dataclasses import dataclass

import orjson
import pool_layout
import pytest
import redis
from sqlalchemy import Engine, create_engine, text

from lorapool import signing
from lorapool.audit_db import DatabaseConfig, create_audit_engine, migrate
from lorapool.lifecycle.keys import Keys
from lorapool.records.audit import sign_record

BASE_MODEL = {"name": "SmolLM2-135M-Instruct", "sha256": "b" * 64}
KEY = signing.key_from_env()  # the test audit key tests/conftest.py sets
# WriterConfig fields for a writer that polls and retries quickly
FAST_WRITER = {"block_ms": 50, "backoff_initial_s": 0.02, "backoff_max_s": 0.2}


@dataclass
class AuditTarget:
    kind: str  # "sqlite" or "postgresql"
    url: str
    schema: str | None
    engine: Engine

    def config(self, **kw) -> DatabaseConfig:
        return DatabaseConfig(url=self.url, schema=self.schema, **kw)

    def cli_args(self) -> list[str]:
        return ["--db-url", self.url] + (["--schema", self.schema] if self.schema else [])

    def count(self) -> int:
        with self.engine.connect() as conn:
            return conn.execute(text("SELECT count(*) FROM completions")).scalar()


def pg_base_url() -> str | None:
    url = os.environ.get("LORAPOOL_TEST_PG_URL")
    return url if url and url.startswith("postgresql") else None


def _create_schema(url: str) -> str:
    schema = f"lorapool_test_{uuid.uuid4().hex[:12]}"
    engine = create_engine(url)
    with engine.begin() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    engine.dispose()
    return schema


def _drop_schema(url: str, schema: str) -> None:
    engine = create_engine(url)
    with engine.begin() as conn:
        conn.execute(text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
    engine.dispose()


@pytest.fixture(params=["sqlite", "postgresql"])
def audit_location(request, tmp_path):
    """(kind, url, schema) of an empty, unmigrated audit database."""
    if request.param == "sqlite":
        yield "sqlite", f"sqlite:///{tmp_path / 'audit.sqlite'}", None
        return
    url = pg_base_url()
    if url is None:
        pytest.skip("LORAPOOL_TEST_PG_URL is not set")
    schema = _create_schema(url)
    try:
        yield "postgresql", url, schema
    finally:
        _drop_schema(url, schema)


@pytest.fixture
def audit_target(audit_location):
    """Migrated audit tables on SQLite or PostgreSQL (see the module docstring)."""
    kind, url, schema = audit_location
    engine = create_audit_engine(DatabaseConfig(url=url, schema=schema))
    migrate(engine)
    yield AuditTarget(kind, url, schema, engine)
    engine.dispose()


@dataclass
class AuditRedis:
    url: str
    conn: redis.Redis  # a redis.RedisCluster on the cluster layout
    prefix: str
    shards: int = 0

    @property
    def keys(self) -> Keys:
        return Keys(self.prefix, self.shards)

    def audit(self, request_id: str) -> str:
        """The ``{p}:audit`` stream of ``request_id``'s shard (the only one unsharded)."""
        return self.keys.for_request(request_id).audit

    def publish(self, records: list[dict], chunk: int = 1000, signed: bool = True) -> list:
        """XADD each record to its shard's ``{p}:audit`` (signed, as a worker does);
        returns the entry ids."""
        key = signing.key_from_env()
        ids = []
        for start in range(0, len(records), chunk):
            pipe = self.conn.pipeline(transaction=False)
            for record in records[start : start + chunk]:
                stream = self.audit(record["request_id"])
                if signed:
                    record = sign_record(record, key, self.prefix)
                pipe.xadd(stream, {"data": orjson.dumps(record)})
            ids.extend(pipe.execute())
        return ids

    def pending(self) -> int:
        """Audit entries delivered and not acked, over every shard."""
        total = 0
        for view in self.keys.shard_views:
            with contextlib.suppress(redis.ResponseError):  # no group yet
                total += self.conn.xpending(view.audit, "audit")["pending"]
        return total

    def dead(self) -> list:
        """Every shard's ``{p}:dead`` entries, shard by shard."""
        return pool_layout.entries(self.conn, self.keys, "dead")


@pytest.fixture
def audit_redis(pool_url, conn, prefix, shards):
    """The layout's client and a key prefix of this test's own (tests/integration/
    conftest.py: standalone, or the cluster in a module with ``LAYOUTS``); the
    prefix fixture deletes its keys afterwards."""
    return AuditRedis(pool_url, conn, prefix, shards)


def make_adapter(name: str = "sql-lora", adapter_id: int = 1, version: int = 1) -> dict:
    return {
        "name": name,
        "id": adapter_id,
        "path": f"/adapters/{name}/v{version}",
        "sha256": f"{adapter_id:04x}{version:04x}".ljust(64, "a"),
        "rank": 8,
        "alpha": 16.0,
        "target_modules": ["q_proj", "v_proj"],
        "base_model": BASE_MODEL["name"],
    }


def make_record(
    i: int,
    *,
    adapter: dict | None = None,
    tenant: str | None = "acme",
    n: int = 1,
    finish_reason: str = "stop",
    error: str | None = None,
    arrival: float | None = None,
    latency: float = 0.5,
    text_for=lambda i, k: f"completion {k} of request {i}",
) -> dict:
    """A valid audit record dict for request ``req-<i>``."""
    arrival = 1_700_000_000.0 + i if arrival is None else arrival
    outputs = [
        {
            "index": k,
            "text": text_for(i, k),
            "token_ids": [i % 97, k, 7],
            "cumulative_logprob": -1.5 - k,
            "finish_reason": finish_reason,
            "stop_reason": None,
        }
        for k in range(n)
    ]
    return {
        "v": 1,
        "request_id": f"req-{i}",
        "prompt": f"prompt {i}",
        "prompt_token_ids": [1, 2, 3, i % 50],
        "sampling_params": {"temperature": 0.7, "max_tokens": 16, "n": n},
        "metadata": {} if tenant is None else {"tenant": tenant},
        "worker": "worker-0",
        "base_model": dict(BASE_MODEL),
        "adapter": adapter,
        "metrics": {
            "arrival_time": arrival,
            "first_scheduled_time": arrival + 0.01,
            "first_token_time": arrival + 0.1,
            "last_token_time": arrival + latency,
            "finished_time": arrival + latency,
            "queue_time": 0.01,
            "num_prompt_tokens": 4,
            "num_generated_tokens": 3 * n,
        },
        "outputs": outputs,
        "error": error,
    }


def random_records(count: int, seed: int = 0) -> list[dict]:
    """A varied data set: adapters and versions, tenants, n, finish reasons, errors."""
    rng = random.Random(seed)
    adapters = [
        None,
        make_adapter("sql-lora", 1, 1),
        make_adapter("sql-lora", 1, 2),
        make_adapter("chat-lora", 2, 1),
    ]
    records = []
    for i in range(count):
        reason = rng.choice(["stop", "stop", "length", "abort", "error"])
        records.append(
            make_record(
                i,
                adapter=rng.choice(adapters),
                tenant=rng.choice(["acme", "globex", None]),
                n=rng.choice([1, 1, 2]),
                finish_reason=reason,
                error="worker crashed" if reason == "error" else None,
                latency=round(rng.uniform(0.05, 3.0), 3),
                text_for=lambda i, k: (
                    rng.choice(["SELECT 1;", "hello world", "Hello there"]) + f" #{i}.{k}"
                ),
            )
        )
    return records


def wait_for(predicate, timeout: float = 30.0, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TcpProxy:
    """Forwards 127.0.0.1:``port`` to ``target``; stop() cuts every connection."""

    def __init__(self, port: int, target: tuple[str, int]):
        self.port, self.target = port, target
        self._listener: socket.socket | None = None
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()

    def start(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen()
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def stop(self) -> None:
        with self._lock:
            sockets, self._sockets = self._sockets + [self._listener], []
            self._listener = None
        for sock in sockets:
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
                upstream = socket.create_connection(self.target)
            except OSError:
                return
            with self._lock:
                self._sockets += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)


def drain_writer(audit_redis, target, prefix=None, consumer="w-test"):
    """Run an audit writer over ``audit_redis``'s audit stream into ``target`` until it
    is empty (burst); its summary."""
    from lorapool.audit_db import AuditWriter, WriterConfig

    prefix = prefix or audit_redis.prefix
    config = WriterConfig(
        prefix=prefix, shards=audit_redis.shards, consumer=consumer, **FAST_WRITER
    )
    return AuditWriter(audit_redis.conn, target.engine, config).run(burst=True)
