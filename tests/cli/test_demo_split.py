"""``lorapool demo`` shows a burst split between its two workers (issue 33, row 9): with
adapter affinity on, each adapter's jobs go to its rendezvous home, so the demo's worker
names must give its adapters homes on both workers, or one worker serves 6 of 8."""

from collections import Counter

from lorapool.cli.demo_pipeline import JOBS, WORKERS
from lorapool.worker.intake import home_of


def test_the_demo_adapters_have_homes_on_both_workers():
    homes = Counter(home_of(adapter, list(WORKERS)) for _, adapter in JOBS if adapter)
    assert set(homes) == set(WORKERS)
    # base-model jobs go by fair share alone; the adapters' jobs split at worst 4/2
    assert max(homes.values()) <= 4


def test_home_of_is_the_rendezvous_choice_every_worker_makes():
    names = ["w1", "w2", "w3"]
    for adapter in ("a", "b", "sql-writer"):
        first = home_of(adapter, names)
        assert home_of(adapter, list(reversed(names))) == first
        # a worker leaving moves only the adapters homed at it
        rest = [n for n in names if n != "w3"]
        if first != "w3":
            assert home_of(adapter, rest) == first


def test_a_second_demo_refuses_to_start_while_one_runs(tmp_path, monkeypatch):
    """Two demos share the cache dir's embedded Redis and key prefix: the second would
    clear the first's jobs, so it stops at once with a line saying why."""
    import click
    import pytest

    from lorapool.cli.demo_pipeline import one_demo_at_a_time

    monkeypatch.setenv("LORAPOOL_CACHE_DIR", str(tmp_path))
    busy = pytest.raises(click.ClickException, match="another `lorapool demo` is running")
    with one_demo_at_a_time(), busy, one_demo_at_a_time():
        pass
    with one_demo_at_a_time():  # free again once the first ended
        pass


def test_the_demo_kills_a_child_that_outlives_its_sigterm():
    """stop_children: SIGTERM, then SIGKILL past the timeout; a child that ignores SIGTERM
    (as a gateway stuck in its shutdown did) is not left running, one that heeds it exits
    by it."""
    import signal
    import subprocess
    import sys
    import time

    from lorapool.cli.demo_pipeline import stop_children

    deaf = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); " + (
        "print('ready', flush=True); time.sleep(60)"
    )
    heeds = "import time; print('ready', flush=True); time.sleep(60)"
    procs = [
        subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
        for code in (deaf, heeds)
    ]
    for proc in procs:  # the handler is in place before the signal comes
        assert proc.stdout.readline() == b"ready\n"
    started = time.monotonic()
    stop_children(procs, timeout_s=1)
    assert time.monotonic() - started < 10
    assert [proc.returncode for proc in procs] == [-signal.SIGKILL, -signal.SIGTERM]
    for proc in procs:
        proc.stdout.close()
