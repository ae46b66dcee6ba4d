"""``lorapool exporter`` as its own process: the pool's gauges against Redis's own answers.

The oracle is Redis (XLEN, XINFO GROUPS) read by the test; the exposition is
read with prometheus-client's parser.
"""

import math
import os
import subprocess
import sys
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from lorapool.connection import ensure_group
from lorapool.lifecycle.keys import AUDIT_GROUP, WORKERS_GROUP
from lorapool.protocol import SamplingParams

pytestmark = pytest.mark.integration
GAUGES = [
    "lorapool_queue_length",
    "lorapool_queue_pending",
    "lorapool_queue_lag",
    "lorapool_batch_queue_length",
    "lorapool_batch_queue_pending",
    "lorapool_batch_queue_lag",
    "lorapool_dead_letters",
    "lorapool_workers_live",
    "lorapool_audit_backlog",
    "lorapool_redis_up",
]


@pytest.fixture
def exporter(redis_url, prefix, tmp_path):
    cmd = [sys.executable, "-c", "from lorapool.cli.main import main; main()", "exporter"]
    cmd += ["--redis-url", redis_url, "--prefix", prefix, "--port", "0", "--addr", "127.0.0.1"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, text=True, env=os.environ)
    line = proc.stdout.readline()  # "serving P's pool metrics on http://127.0.0.1:PORT/metrics"
    assert "/metrics" in line, line
    yield line.split()[-1]
    proc.terminate()
    proc.wait(timeout=10)


def scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=5) as reply:
        families = list(text_string_to_metric_families(reply.read().decode()))
    assert {f.name: f.type for f in families} == dict.fromkeys(GAUGES, "gauge")
    return {f.name: f.samples[0].value for f in families}


def group(conn, stream, name):
    return next(g for g in conn.xinfo_groups(stream) if g["name"].decode() == name)


def test_gauges_equal_what_redis_reports(exporter, conn, producer):
    keys = producer.keys
    ensure_group(conn, keys.requests, WORKERS_GROUP)
    producer.submit_many([f"job {i}" for i in range(5)], SamplingParams(max_tokens=4))
    got = scrape(exporter)
    assert got["lorapool_queue_lag"] == group(conn, keys.requests, WORKERS_GROUP)["lag"] == 5
    assert got["lorapool_queue_length"] == 5 and got["lorapool_queue_pending"] == 0
    assert got["lorapool_batch_queue_length"] == got["lorapool_batch_queue_lag"] == 0

    ensure_group(conn, keys.batch_requests, WORKERS_GROUP)
    producer.submit_many([f"line {i}" for i in range(4)], SamplingParams(), priority="batch")
    conn.xreadgroup(WORKERS_GROUP, "c1", {keys.batch_requests: ">"}, count=1)
    got = scrape(exporter)
    batch = group(conn, keys.batch_requests, WORKERS_GROUP)
    assert got["lorapool_batch_queue_lag"] == batch["lag"] == 3
    assert got["lorapool_batch_queue_pending"] == batch["pending"] == 1
    assert got["lorapool_batch_queue_length"] == 4
    assert got["lorapool_queue_lag"] == 5  # the interactive stream's alone

    conn.xreadgroup(WORKERS_GROUP, "c1", {keys.requests: ">"}, count=2)
    conn.xadd(keys.dead, {"reason": "x"})
    conn.hset(keys.workers, mapping={"w1": b"{}", "w2": b"{}"})
    conn.set(keys.alive("w1"), 1, ex=30)  # w2's heartbeat has expired
    for i in range(3):
        conn.xadd(keys.audit, {"data": str(i)})
    ensure_group(conn, keys.audit, AUDIT_GROUP)
    conn.xreadgroup(AUDIT_GROUP, "writer", {keys.audit: ">"}, count=1)
    got = scrape(exporter)
    requests = group(conn, keys.requests, WORKERS_GROUP)
    assert got["lorapool_queue_lag"] == requests["lag"] == 3
    assert got["lorapool_queue_pending"] == requests["pending"] == 2
    assert got["lorapool_dead_letters"] == conn.xlen(keys.dead) == 1
    assert got["lorapool_workers_live"] == 1 and got["lorapool_redis_up"] == 1
    audit = group(conn, keys.audit, AUDIT_GROUP)
    assert got["lorapool_audit_backlog"] == audit["lag"] + audit["pending"] == 3


def test_lag_unknown_after_deleting_an_undelivered_entry(exporter, conn, producer):
    """The negative control: Redis cannot count the lag past a deleted entry it never
    delivered, and the gauge says so (NaN) rather than a wrong number."""
    keys = producer.keys
    ensure_group(conn, keys.requests, WORKERS_GROUP)
    producer.submit_many([f"job {i}" for i in range(5)], SamplingParams(max_tokens=4))
    conn.xreadgroup(WORKERS_GROUP, "c1", {keys.requests: ">"}, count=1)
    undelivered = conn.xrange(keys.requests)[2][0]
    conn.xdel(keys.requests, undelivered)
    assert group(conn, keys.requests, WORKERS_GROUP)["lag"] is None
    assert math.isnan(scrape(exporter)["lorapool_queue_lag"])
