"""WorkerConfig and WebhookConfig refuse a bad option naming it and its value, their
bounds written once on the fields (``config_fields.check_fields``); no server."""

import math
import re

import orjson
import pytest

from lorapool.batch.deliveries import WebhookConfig
from lorapool.config_fields import OptionError
from lorapool.worker.config import WorkerConfig

COUNT = f"an integer in [1, {2**63 - 1}]"  # a count Redis takes (bounds.Count)


def worker(**options) -> WorkerConfig:
    return WorkerConfig(insecure_no_key=True, **options)


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("lease_s", 0, "lease_s must be a finite number > 0, got 0"),
        ("lease_s", math.nan, "lease_s must be a finite number > 0, got nan"),
        ("lease_s", math.inf, "lease_s must be a finite number > 0, got inf"),
        ("lease_s", True, "lease_s must be a finite number > 0, got True"),
        ("heartbeat_s", "1", "heartbeat_s must be a finite number > 0, got '1'"),
        ("max_deliveries", 0, f"max_deliveries must be {COUNT}, got 0"),
        ("block_ms", 2.5, f"block_ms must be {COUNT}, got 2.5"),
        ("dead_max_len", 2**70, f"dead_max_len must be {COUNT}, got {2**70}"),
        ("result_ttl_s", 0, "result_ttl_s must be an integer in [1, 31622400], got 0"),
        ("log_grace_s", False, f"log_grace_s must be {COUNT}, got False"),
        ("max_chunk_rate", -1, f"max_chunk_rate must be an integer in [0, {2**63 - 1}], got -1"),
        ("batch_share", 0, "batch_share must be a finite number in (0, 1], got 0"),
        ("batch_share", math.nan, "batch_share must be a finite number in (0, 1], got nan"),
        ("interactive_window_s", -1.0,
         "interactive_window_s must be a number >= 0, got -1.0"),
        ("metrics_port", 65536,
         "metrics_port must be an integer in [0, 65535] (or None), got 65536"),
        ("metrics_max_adapters", 1, "metrics_max_adapters must be an integer >= 2, got 1"),
        ("burst", 1, "burst=1: Expected `bool`, got `int`"),
        ("name", "w\x00", None),  # a name is any string: taken
        ("alive_ttl_s", 1,
         "alive_ttl_s (1) must be a whole number of seconds above heartbeat_s (1.0)"),
    ],
)  # fmt: skip
def test_a_bad_worker_option_is_refused_naming_it_and_its_value(option, value, message):
    if message is None:
        assert getattr(worker(**{option: value}), option) == value
        return
    with pytest.raises(OptionError, match=f"^{re.escape(message)}$") as refused:
        worker(**{option: value})
    assert refused.value.field == option


def test_the_worker_bounds_themselves_are_taken():
    config = worker(
        lease_s=1e-3, batch_share=1, interactive_window_s=math.inf, max_chunk_rate=0,
        metrics_port=0, metrics_max_adapters=2, result_ttl_s=366 * 24 * 3600,
        alive_ttl_s=2, heartbeat_s=1.5, drain_timeout_s=0,
    )  # fmt: skip
    assert config.lease_ms == 1 and config.interactive_window_s == math.inf
    worker(metrics_port=65535, dead_max_len=2**63 - 1)


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("max_attempts", 0, "max_attempts must be an integer >= 1, got 0"),
        ("max_attempts", True, "max_attempts must be an integer >= 1, got True"),
        ("tenant_concurrency", "2", "tenant_concurrency must be an integer >= 1, got '2'"),
        ("backoff_s", 0, "backoff_s must be a finite number > 0, got 0"),
        ("backoff_s", math.nan, "backoff_s must be a finite number > 0, got nan"),
        ("backoff_s", 601, "backoff_s (601) must be at most backoff_cap_s (600.0)"),
        ("backoff_cap_s", math.inf, "backoff_cap_s must be a finite number > 0, got inf"),
        ("allow", ["10.0.0.0/8", 5],
         "allow=('10.0.0.0/8', 5): Expected `str`, got `int` - at `$[1]`"),
        ("queue", None, "queue=None: Expected `str`, got `null`"),
    ],
)  # fmt: skip
def test_a_bad_webhook_option_is_refused_naming_it_and_its_value(option, value, message):
    with pytest.raises(OptionError, match=f"^{re.escape(message)}$") as refused:
        WebhookConfig(**{option: value})
    assert refused.value.field == option


def test_a_webhook_config_survives_the_rq_jobs_json():
    """It travels with each RQ job as JSON (``allow`` comes back a list): read back, it
    is the same config, checked again."""
    config = WebhookConfig(allow=("hooks.internal", "10.1.0.0/16"), max_attempts=3)
    again = WebhookConfig(**orjson.loads(orjson.dumps(config.to_dict())))
    assert again == config and again.allow == config.allow
