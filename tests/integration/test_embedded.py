"""The embedded Redis (``lorapool.embedded``) is Redis >= 7: what a fresh machine's
``make test`` and ``lorapool demo`` run on serves every feature the docs describe.

Each test starts the embedded binary itself (not ``$LORAPOOL_TEST_REDIS_URL``): the
features checked are those of the server a machine without one gets.
"""

import subprocess

import pytest
import redis

from lorapool.embedded import EmbeddedServer, cli_executable, server_executable


@pytest.fixture
def server(tmp_path):
    try:
        server_executable()
    except RuntimeError as exc:
        pytest.skip(str(exc))
    started = EmbeddedServer(tmp_path / "redis", persist=False).start()
    yield started
    started.stop()


def test_the_embedded_server_speaks_redis_7(server):
    r = redis.Redis.from_url(server.url)
    major = int(r.info("server")["redis_version"].split(".")[0])
    assert major >= 7
    # XINFO GROUPS reports the group's lag (KEDA's redis-streams lag mode)
    r.xgroup_create("s", "g", id="0", mkstream=True)
    r.xadd("s", {"a": 1})
    r.xadd("s", {"a": 2})
    r.xreadgroup("g", "c", {"s": ">"}, count=1)
    assert r.xinfo_groups("s")[0]["lag"] == 1
    # sharded Pub/Sub and the script shebang with flags
    assert r.execute_command("SPUBLISH", "chan", "x") == 0
    assert r.eval("#!lua flags=no-writes\nreturn redis.call('GET', KEYS[1])", 1, "k") is None
    r.close()


def test_the_cli_beside_it_talks_to_it(server):
    cli = cli_executable()
    assert cli is not None
    out = subprocess.run([cli, "-s", str(server.socket), "ping"], capture_output=True, text=True)
    assert out.stdout.strip() == "PONG"


def test_data_survive_a_restart_and_a_long_directory(tmp_path):
    try:
        server_executable()
    except RuntimeError as exc:
        pytest.skip(str(exc))
    deep = tmp_path / ("d" * 60) / ("e" * 60)  # too long for a unix socket's path
    first = EmbeddedServer(deep).start()
    assert len(str(first.socket)) <= 100
    redis.Redis.from_url(first.url).set("kept", "yes")
    first.stop()
    second = EmbeddedServer(deep).start()  # the same socket name, and the saved data
    try:
        assert second.socket == first.socket
        assert redis.Redis.from_url(second.url).get("kept") == b"yes"
    finally:
        second.stop()


def test_the_shared_server_stops_when_its_last_user_stops(tmp_path):
    """Two gateways that found no REDIS_URL share one embedded server; a third gets its
    URL from the first (as the demo's children do). SIGTERM to the first two at once:
    the server runs on for the third; SIGTERM to the third: the server stops. (It used
    to count connections: the two saw each other, and their own pools, and neither
    stopped it; the third never counted; it outlived them all with PPID 1.)"""
    import os
    import signal
    import time

    from gateway_procs import free_port, lorapool_cmd, stop, wait_answering

    try:
        server_executable()
    except RuntimeError as exc:
        pytest.skip(str(exc))
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "LORAPOOL_EMBEDDED_DIR")}
    env["LORAPOOL_CACHE_DIR"] = str(tmp_path / "cache")
    directory = tmp_path / "cache" / "redis"

    def gateway(extra: dict) -> subprocess.Popen:
        port = free_port()
        cmd = lorapool_cmd("serve", "--no-auth", "--port", str(port))
        proc = subprocess.Popen(cmd, env={**env, **extra}, cwd=tmp_path)
        wait_answering(proc, f"http://127.0.0.1:{port}/healthz", "lorapool serve")
        return proc

    def server_alive() -> bool:
        return EmbeddedServer(directory).answers()

    first = gateway({})
    procs = [first]
    try:
        pid = int((directory / "redis.pid").read_text())
        procs.append(gateway({}))
        url = EmbeddedServer(directory).url
        procs.append(gateway({"REDIS_URL": url, "LORAPOOL_EMBEDDED_DIR": str(directory)}))
        for proc in procs[:2]:  # at the same moment
            proc.send_signal(signal.SIGTERM)
        for proc in procs[:2]:
            proc.wait(30)
        assert server_alive(), "the server stopped under its third user"
        stop(procs[2])
        deadline = time.monotonic() + 15
        while server_alive():
            assert time.monotonic() < deadline, f"the server (pid {pid}) outlived its users"
            time.sleep(0.1)
    finally:
        for proc in procs:
            if proc.poll() is None:
                stop(proc)
        if server_alive():
            EmbeddedServer(directory).stop()
