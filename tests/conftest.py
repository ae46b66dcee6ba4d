"""Shared fixtures: models made in-process or from PyPI, and Redis / SQL servers.

``tests/support`` is on ``sys.path`` (pyproject's pytest ``pythonpath``).
"""

import os

import pytest

# Test modules import names from the audit_fixtures plugin at their top, before
# pytest loads it as their plugin: have its asserts rewritten all the same.
pytest.register_assert_rewrite("audit_fixtures")

# Audit records are signed; workers and writers refuse to start without a key.
# Every test (and every process a test starts) uses this one unless it says otherwise.
TEST_AUDIT_KEY = "lorapool-test-audit-key-0123456789abcdef"
os.environ["LORAPOOL_AUDIT_KEY"] = TEST_AUDIT_KEY
os.environ.pop("LORAPOOL_AUDIT_KEY_FILE", None)
os.environ.pop("LORAPOOL_AUDIT_INSECURE", None)
# No DNS in CI: the egress module's test resolver hook names a public host (example.com's
# address) and one that resolves inward, for this process and the ones it starts.
os.environ["LORAPOOL_EGRESS_RESOLVE"] = "hooks.example.com=93.184.216.34,inward.example=127.0.0.1"

try:  # `pytest --hypothesis-profile=long`: the property tests at length, on demand
    from hypothesis import settings as _hypothesis_settings

    _hypothesis_settings.register_profile("long", max_examples=3000)
except ImportError:  # a producer-only install has no dev tools
    pass

try:
    import torch

    torch.set_num_threads(2)
except ImportError:  # a producer-only install has no torch
    pass


@pytest.fixture(scope="session")
def smollm2_path():
    """The prepared SmolLM2-135M-Instruct directory (made once, then cached)."""
    from lorapool.cli.prepare import prepare_smollm2

    return prepare_smollm2(progress=False)


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path)


@pytest.fixture(scope="session")
def tiny_tokenizer_path(tmp_path_factory):
    from tiny_tokenizer import build_tiny_tokenizer

    return build_tiny_tokenizer(tmp_path_factory.mktemp("tiny-tokenizer"))


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory):
    """Factory: ``tiny_model_path(arch, **kw)`` -> a directory with a tiny model and tokenizer.

    ``kw`` goes to ``build_tiny_model``; the tokenizer gets the model's vocab size.
    Directories are built once per argument set and shared: do not write into them.
    """
    from tiny_models import build_tiny_model
    from tiny_tokenizer import build_tiny_tokenizer

    built = {}

    def make(arch="llama", **kw):
        key = (arch, repr(sorted(kw.items())))
        if key not in built:
            path = build_tiny_model(arch, tmp_path_factory.mktemp(f"tiny-{arch}"), **kw)
            built[key] = build_tiny_tokenizer(path, vocab_size=kw.get("vocab_size", 512))
        return built[key]

    return make


@pytest.fixture(scope="module")
def base(tiny_model_path):
    """The tiny llama's directory: the base model of tests that need one that runs."""
    return tiny_model_path("llama")


@pytest.fixture(scope="module")
def model(base):
    """``base`` as a string, as a command line or ``LLM(model)`` takes it."""
    return str(base)


@pytest.fixture(scope="module")
def base_name(model):
    """The name a pool serves the base model under: its directory's."""
    from pathlib import Path

    return Path(model).name


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    """``$LORAPOOL_TEST_REDIS_URL``, else a private embedded Redis >= 7 (Valkey 8) for
    the session (``lorapool.embedded``), on a unix socket, stopped after."""
    url = os.environ.get("LORAPOOL_TEST_REDIS_URL")
    if url:
        yield url
        return
    from lorapool.embedded import EmbeddedServer, server_executable

    try:
        server_executable()
    except RuntimeError as exc:
        pytest.skip(f"no LORAPOOL_TEST_REDIS_URL and {exc}")
    server = EmbeddedServer(tmp_path_factory.mktemp("redis"), persist=False).start()
    yield server.url
    server.stop()


@pytest.fixture
def pg_url(tmp_path):
    """``$LORAPOOL_TEST_PG_URL``, else a fresh SQLite file for this test."""
    return os.environ.get("LORAPOOL_TEST_PG_URL") or f"sqlite:///{tmp_path / 'audit.db'}"


@pytest.fixture(scope="module")
def conn(redis_url):
    """A Redis client for the module (the queue tests' own is per test)."""
    import redis

    connection = redis.Redis.from_url(redis_url)
    yield connection
    connection.close()
