"""The gateway's configuration refuses a bad option naming it and its value (no server)."""

import re

import pytest

from lorapool.gateway.config import GatewayConfig
from lorapool.protocol import MAX_STOP
from lorapool.tool_calls import PARSERS

URL = "redis://127.0.0.1:6379/0"


def test_the_defaults_are_valid():
    config = GatewayConfig(URL)
    assert config.max_stop == 4 and config.redis_connections == 64


@pytest.mark.parametrize(
    "option, value, message",
    [
        ("max_prompt_bytes", -1, "max_prompt_bytes must be an integer >= 0, got -1"),
        ("max_n", True, "max_n must be an integer >= 0, got True"),
        ("max_prompts", 2.5, "max_prompts must be an integer >= 0, got 2.5"),
        ("redis_retries", "1", "redis_retries must be an integer >= 0, got '1'"),
        ("max_stop", MAX_STOP + 1, f"max_stop must be an integer in [0, {MAX_STOP}], got 65"),
        ("max_stop", -1, f"max_stop must be an integer in [0, {MAX_STOP}], got -1"),
        ("redis_connections", 1, "redis_connections must be an integer >= 2, got 1"),
        ("result_timeout_s", 0, "result_timeout_s must be a finite number > 0, got 0"),
        ("queue_timeout_s", float("inf"), "queue_timeout_s must be a finite number > 0, got inf"),
        ("redis_timeout_s", 3601, "redis_timeout_s must be a finite number in (0, 3600], got 3601"),
        ("redis_outage_s", -5.0, "redis_outage_s must be a finite number in (0, 3600], got -5.0"),
        ("max_backlog", "10", "max_backlog must be an integer >= 0 (or None), got '10'"),
        ("max_backlog", -1, "max_backlog must be an integer >= 0 (or None), got -1"),
        (
            "events_max_s",
            float("nan"),
            "events_max_s must be a finite number > 0 (or None), got nan",
        ),
        ("events_max_s", 0, "events_max_s must be a finite number > 0 (or None), got 0"),
        ("max_body_bytes", 0, "max_body_bytes must be an integer >= 1 (or None), got 0"),
        ("retry_after_s", -1, "retry_after_s must be an integer >= 0, got -1"),
        ("session_ttl_s", 0, "session_ttl_s must be an integer >= 1, got 0"),
        ("auth", 1, "auth=1: Expected `bool`, got `int`"),
        ("cors_origins", ("a", 5), "cors_origins=('a', 5): Expected `str`, got `int` - at `$[1]`"),
    ],
)
def test_a_bad_option_is_refused_naming_it_and_its_value(option, value, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        GatewayConfig(URL, **{option: value})


def test_the_bounds_themselves_are_valid():
    GatewayConfig(URL, max_stop=MAX_STOP, redis_connections=2, redis_timeout_s=3600, max_n=0)


def test_a_tool_call_parser_or_webhook_entry_of_no_kind_is_refused():
    with pytest.raises(ValueError, match=f"tool_call_parser must be auto or one of {PARSERS[0]}"):
        GatewayConfig(URL, tool_call_parser="nope")
    with pytest.raises(ValueError, match="'10.0.0.0/33' is neither a network nor a host name"):
        GatewayConfig(URL, webhook_allow=("10.0.0.0/33",))
