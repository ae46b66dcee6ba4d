"""How benchmarks/audit_scale.py measures: time in SQL, peak memory in this process,
a CLI command's time and peak RSS (a process of its own), a gateway's answers."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class PeakRSS:
    """The highest resident size above the start, sampled every 5 ms (MiB)."""

    def __enter__(self):
        self.start, self.peak, self._done = rss(), 0, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._done.wait(0.005):
            self.peak = max(self.peak, rss() - self.start)

    def __exit__(self, *exc):
        self._done.set()
        self._thread.join()
        self.peak = max(self.peak, rss() - self.start)

    @property
    def mib(self) -> float:
        return self.peak / 2**20


class SQLTimer:
    """Seconds spent in ``cursor.execute`` on an engine (the statement, the server's
    work and, for a client-side cursor, the rows coming back)."""

    def __init__(self, engine):
        from sqlalchemy import event

        self.total = 0.0
        self._started: dict[int, float] = {}
        event.listen(engine, "before_cursor_execute", self._before)
        event.listen(engine, "after_cursor_execute", self._after)

    def _before(self, conn, cursor, statement, params, context, many):
        self._started[id(cursor)] = time.perf_counter()

    def _after(self, conn, cursor, statement, params, context, many):
        self.total += time.perf_counter() - self._started.pop(id(cursor), time.perf_counter())

    @contextmanager
    def measure(self):
        start = self.total
        result = {}
        yield result
        result["sql_s"] = self.total - start


def in_process(timer: SQLTimer, fn, repeat: int = 5) -> dict:
    """Median wall and SQL time of ``fn()`` over ``repeat`` warm runs, and the peak
    memory of one run."""
    fn()  # warm: caches, the planner's statistics
    walls, sqls = [], []
    for _ in range(repeat):
        with timer.measure() as sql:
            start = time.perf_counter()
            fn()
            walls.append(time.perf_counter() - start)
        sqls.append(sql["sql_s"])
    with PeakRSS() as memory:
        fn()
    return {
        "s": statistics.median(walls),
        "sql_s": statistics.median(sqls),
        "peak_mib": round(memory.mib, 1),
    }


def cli(args: list[str], env: dict, stdout=subprocess.DEVNULL) -> dict:
    """``lorapool ARGS`` as a user runs it: wall time and the process's peak RSS (GNU
    time's %M: the command's own, not this process's pages a fork would share)."""
    lorapool = [sys.executable, "-c", "from lorapool.cli.main import main; main()", *args]
    cmd = ["/usr/bin/time", "-f", "peak_kb=%M", *lorapool]
    start = time.perf_counter()
    run = subprocess.run(cmd, env=env, stdout=stdout, stderr=subprocess.PIPE, check=False)
    wall = time.perf_counter() - start
    err = run.stderr.decode()
    if run.returncode != 0:
        raise RuntimeError(f"lorapool {' '.join(args)} failed ({run.returncode}): {err[-2000:]}")
    peak_kb = int(err.rsplit("peak_kb=", 1)[1].split()[0])
    return {"s": wall, "peak_mib": round(peak_kb / 1024, 1)}


def hwm_mib(pid: int) -> float:
    """A process's peak resident size so far (VmHWM)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return 0.0


def http(client, url: str, params: dict, pid: int, repeat: int = 5, headers=None) -> dict:
    """Median time of a GET (warm) and how far it raised the gateway's peak RSS."""
    client.get(url, params=params, headers=headers)
    before = hwm_mib(pid)
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        response = client.get(url, params=params, headers=headers)
        times.append(time.perf_counter() - start)
        response.raise_for_status()
    return {
        "s": statistics.median(times),
        "gateway_peak_growth_mib": round(hwm_mib(pid) - before, 1),
        "bytes": len(response.content),
    }


def stream_http(client, url: str, params: dict, pid: int) -> dict:
    """One streamed download: time, bytes, and the gateway's peak RSS before and after."""
    before = hwm_mib(pid)
    start = time.perf_counter()
    size = 0
    with client.stream("GET", url, params=params) as response:
        response.raise_for_status()
        for chunk in response.iter_bytes():
            size += len(chunk)
    return {
        "s": time.perf_counter() - start,
        "bytes": size,
        "gateway_peak_mib_before": round(before, 1),
        "gateway_peak_mib_after": round(hwm_mib(pid), 1),
    }
