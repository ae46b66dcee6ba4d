"""``lorapool worker``'s engine options reach the engine: ``--starvation-steps`` (the
scheduler's bound on a skipped request's wait, issue 31 Build 4) is in ``--help`` and
sets the real engine's ``SchedulerConfig``; a value the worker's (or the gateway's)
config refuses is a usage error naming the option, not a traceback."""

import pytest
from click.testing import CliRunner

from lorapool.cli.main import cli


def worker_line(model, monkeypatch, *options):
    """``lorapool worker --model model options`` invoked with serving stubbed out: its
    result and the EngineArgs it would have served with."""
    from lorapool.worker import serve

    got = {}
    monkeypatch.setattr(serve, "serve", lambda args, config, conn: got.update(args=args))
    line = ["worker", "--model", model, "--redis-url", "redis://127.0.0.1:1/0"]
    return CliRunner().invoke(cli, [*line, "--insecure-no-key", *options]), got.get("args")


def test_starvation_steps_reaches_the_scheduler(model, monkeypatch):
    from lorapool.engine.llm_engine import LLMEngine

    done, args = worker_line(model, monkeypatch, "--starvation-steps", "3")
    assert done.exit_code == 0, done.output
    assert LLMEngine.from_engine_args(args).scheduler.config.starvation_steps == 3
    done, args = worker_line(model, monkeypatch)
    assert done.exit_code == 0 and args.starvation_steps == 8  # the scheduler's


def test_tenant_prefill_cap_reaches_the_scheduler(model, monkeypatch):
    """``--tenant-prefill-cap`` (issue 51 row 4): the scheduler's contended prefill cap."""
    from lorapool.engine.llm_engine import LLMEngine

    done, args = worker_line(model, monkeypatch, "--tenant-prefill-cap", "64")
    assert done.exit_code == 0, done.output
    assert LLMEngine.from_engine_args(args).scheduler.config.contended_prefill_tokens == 64
    done, _ = worker_line(model, monkeypatch, "--tenant-prefill-cap", "0")
    assert done.exit_code == 2 and "--tenant-prefill-cap" in done.output


@pytest.mark.parametrize("bad", ["0", "-1", "x"])
def test_starvation_steps_is_refused_below_one(bad):
    line = ["worker", "--model", "m", "--redis-url", "redis://127.0.0.1:1/0"]
    done = CliRunner().invoke(cli, [*line, "--insecure-no-key", "--starvation-steps", bad])
    assert done.exit_code == 2 and "--starvation-steps" in done.output


def test_starvation_steps_is_in_the_help():
    shown = CliRunner().invoke(cli, ["worker", "--help"], terminal_width=200).output
    assert "--starvation-steps" in shown and "default: 8" in shown.split("--starvation-steps")[1]


@pytest.mark.parametrize(
    ("option", "value", "words"),
    [
        ("--lease", "0", "lease_s must be a finite number > 0, got 0.0"),
        ("--lease", "nan", "lease_s must be a finite number > 0, got nan"),
        ("--metrics-port", "70000", "metrics_port must be an integer in [0, 65535]"),
        ("--log-grace", str(2**70), f"got {2**70}"),
        ("--result-ttl", str(400 * 24 * 3600), "result_ttl_s must be an integer in [1, "),
    ],
)
def test_a_value_the_worker_config_refuses_is_a_usage_error_naming_the_option(option, value, words):
    """WorkerConfig's own bounds (``check_fields``), met on the command line: exit 2 and
    one line naming the option and the value, not a traceback."""
    line = ["worker", "--model", "m", "--redis-url", "redis://127.0.0.1:1/0"]
    done = CliRunner().invoke(cli, [*line, "--insecure-no-key", option, value])
    assert done.exit_code == 2, done.output
    assert f"Invalid value for '{option}'" in done.output and words in done.output, done.output
    assert "Traceback" not in done.output


def test_a_gateway_option_its_config_refuses_names_the_option():
    """``lorapool serve``'s config (``GatewayConfig``), refusing an option whose field
    is named with its unit (``result_timeout_s`` from ``--result-timeout``)."""
    line = ["serve", "--redis-url", "redis://127.0.0.1:1/0", "--result-timeout", "inf"]
    done = CliRunner().invoke(cli, line)
    assert done.exit_code == 2, done.output
    assert "Invalid value for '--result-timeout'" in done.output, done.output
    assert "result_timeout_s must be a finite number > 0, got inf" in done.output
