"""Settings read from the environment, in one place."""

import os
from pathlib import Path

SMOLLM2_NAME = "SmolLM2-135M-Instruct"


def cache_dir() -> Path:
    """Where prepared models live: ``$LORAPOOL_CACHE_DIR`` or ``~/.cache/lorapool``."""
    return Path(os.environ.get("LORAPOOL_CACHE_DIR", Path.home() / ".cache" / "lorapool"))


def smollm2_dir() -> Path:
    """The prepared SmolLM2-135M-Instruct Hugging Face directory."""
    return cache_dir() / "models" / SMOLLM2_NAME


def redis_url() -> str | None:
    """``$REDIS_URL``; None means start an embedded Redis."""
    return os.environ.get("REDIS_URL") or None


def db_url() -> str | None:
    """``$LORAPOOL_DB_URL``; None means the default SQLite file."""
    return os.environ.get("LORAPOOL_DB_URL") or None
