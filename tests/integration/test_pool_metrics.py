"""``lorapool exporter`` as its own process: the pool's gauges against Redis's own answers.

The oracle is Redis (XLEN, XINFO GROUPS) read by the test, summed over the shards on
a Redis Cluster; the exposition is read with prometheus-client's parser.
"""

import math
import os
import subprocess
import sys
import urllib.request

import pytest
from pool_layout import length, pending
from prometheus_client.parser import text_string_to_metric_families

from lorapool.connection import ensure_group
from lorapool.lifecycle.keys import AUDIT_GROUP, WORKERS_GROUP
from lorapool.protocol import SamplingParams

pytestmark = pytest.mark.integration
LAYOUTS = ("standalone", "cluster")
GAUGES = [
    "lorapool_queue_length",
    "lorapool_queue_pending",
    "lorapool_queue_lag",
    "lorapool_batch_queue_length",
    "lorapool_batch_queue_pending",
    "lorapool_batch_queue_lag",
    "lorapool_queue_work",
    "lorapool_dead_letters",
    "lorapool_workers_live",
    "lorapool_audit_backlog",
    "lorapool_redis_up",
    "lorapool_webhook_dead_letters",
    "lorapool_webhook_tenants_busy",
]
COUNTERS = ["lorapool_webhook_attempts", "lorapool_webhook_attempt_seconds"]


@pytest.fixture
def exporter(pool_url, prefix, shards, tmp_path):
    cmd = [sys.executable, "-c", "from lorapool.cli.main import main; main()", "exporter"]
    cmd += ["--redis-url", pool_url, "--prefix", prefix, "--shards", str(shards)]
    cmd += ["--port", "0", "--addr", "127.0.0.1"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, text=True, env=os.environ)
    line = proc.stdout.readline()  # "serving P's pool metrics on http://127.0.0.1:PORT/metrics"
    assert "/metrics" in line, line
    yield line.split()[-1]
    proc.terminate()
    proc.wait(timeout=10)


def scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=5) as reply:
        families = list(text_string_to_metric_families(reply.read().decode()))
    kinds = {**dict.fromkeys(GAUGES, "gauge"), **dict.fromkeys(COUNTERS, "counter")}
    assert {f.name: f.type for f in families} == kinds
    return {f.name: f.samples[0].value for f in families}


def group(conn, stream, name):
    return next(g for g in conn.xinfo_groups(stream) if g["name"].decode() == name)


def total(conn, keys, stream, name, field):
    """``field`` of group ``name`` of the per-shard ``stream``, summed over the shards."""
    return sum(group(conn, getattr(v, stream), name)[field] for v in keys.shard_views)


def ensure_groups(conn, keys, stream, name=WORKERS_GROUP):
    for view in keys.shard_views:
        ensure_group(conn, getattr(view, stream), name)


def take(conn, keys, stream, count, name=WORKERS_GROUP, consumer="c1"):
    """Delivers ``count`` entries of the per-shard ``stream``, shard after shard."""
    for view in keys.shard_views:
        if count > 0:
            got = conn.xreadgroup(name, consumer, {getattr(view, stream): ">"}, count=count)
            count -= sum(len(entries) for _, entries in got)
    assert count == 0


def test_gauges_equal_what_redis_reports(exporter, conn, producer):
    keys = producer.keys
    ensure_groups(conn, keys, "requests")
    producer.submit_many([f"job {i}" for i in range(5)], SamplingParams(max_tokens=4))
    got = scrape(exporter)
    assert got["lorapool_queue_lag"] == total(conn, keys, "requests", WORKERS_GROUP, "lag") == 5
    assert got["lorapool_queue_length"] == 5 and got["lorapool_queue_pending"] == 0
    assert got["lorapool_batch_queue_length"] == got["lorapool_batch_queue_lag"] == 0

    ensure_groups(conn, keys, "batch_requests")
    producer.submit_many([f"line {i}" for i in range(4)], SamplingParams(), priority="batch")
    take(conn, keys, "batch_requests", 1)
    got = scrape(exporter)
    assert got["lorapool_batch_queue_lag"] == 3
    assert got["lorapool_batch_queue_lag"] == total(conn, keys, "batch_requests", "workers", "lag")
    assert got["lorapool_batch_queue_pending"] == 1
    assert got["lorapool_batch_queue_pending"] == pending(conn, keys, "batch_requests")
    assert got["lorapool_batch_queue_length"] == length(conn, keys, "batch_requests") == 4
    assert got["lorapool_queue_lag"] == 5  # the interactive stream's alone

    take(conn, keys, "requests", 2)
    conn.xadd(keys.on(0).dead, {"reason": "x"})
    conn.hset(keys.workers, mapping={"w1": b"{}", "w2": b"{}"})
    conn.set(keys.alive("w1"), 1, ex=30)  # w2's heartbeat has expired
    views = keys.shard_views
    for i in range(3):  # over the shards, where there are several
        conn.xadd(views[i % len(views)].audit, {"data": str(i)})
    ensure_groups(conn, keys, "audit", AUDIT_GROUP)
    take(conn, keys, "audit", 1, AUDIT_GROUP, "writer")
    got = scrape(exporter)
    assert got["lorapool_queue_lag"] == total(conn, keys, "requests", WORKERS_GROUP, "lag") == 3
    assert got["lorapool_queue_pending"] == pending(conn, keys, "requests") == 2
    # the autoscaling signal: taken (pending) and not taken (lag), both streams
    assert got["lorapool_queue_work"] == 3 + 2 + 3 + 1
    assert got["lorapool_dead_letters"] == length(conn, keys, "dead") == 1
    assert got["lorapool_workers_live"] == 1 and got["lorapool_redis_up"] == 1
    backlog = total(conn, keys, "audit", AUDIT_GROUP, "lag")
    backlog += total(conn, keys, "audit", AUDIT_GROUP, "pending")
    assert got["lorapool_audit_backlog"] == backlog == 3


def test_lag_unknown_after_deleting_an_undelivered_entry(exporter, conn, producer):
    """The negative control: Redis cannot count the lag past a deleted entry it never
    delivered (on one shard), and the gauge says so (NaN) rather than a wrong number."""
    keys = producer.keys
    ensure_groups(conn, keys, "requests")
    ids = [f"r{i}" for i in range(5)]
    producer.submit_many([f"job {i}" for i in range(5)], SamplingParams(max_tokens=4), None, ids)
    # a shard with two entries or more (5 over at most 3 shards): take one, delete one
    stream = next(v.requests for v in keys.shard_views if conn.xlen(v.requests) >= 2)
    conn.xreadgroup(WORKERS_GROUP, "c1", {stream: ">"}, count=1)
    undelivered = conn.xrange(stream)[1][0]
    conn.xdel(stream, undelivered)
    assert group(conn, stream, WORKERS_GROUP)["lag"] is None
    assert math.isnan(scrape(exporter)["lorapool_queue_lag"])
