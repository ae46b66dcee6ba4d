"""``lorapool worker``'s engine options reach the engine: ``--starvation-steps`` (the
scheduler's bound on a skipped request's wait, issue 31 Build 4) is in ``--help`` and
sets the real engine's ``SchedulerConfig``."""

import pytest
from click.testing import CliRunner

from lorapool.cli.main import cli


def test_starvation_steps_reaches_the_scheduler(model, monkeypatch):
    from lorapool.engine.llm_engine import LLMEngine
    from lorapool.worker import serve

    got = {}
    monkeypatch.setattr(serve, "serve", lambda args, config, conn: got.update(args=args))
    line = ["worker", "--model", model, "--redis-url", "redis://127.0.0.1:1/0"]
    done = CliRunner().invoke(cli, [*line, "--insecure-no-key", "--starvation-steps", "3"])
    assert done.exit_code == 0, done.output
    engine = LLMEngine.from_engine_args(got["args"])
    assert engine.scheduler.config.starvation_steps == 3
    done = CliRunner().invoke(cli, [*line, "--insecure-no-key"])
    assert done.exit_code == 0 and got["args"].starvation_steps == 8  # the scheduler's


@pytest.mark.parametrize("bad", ["0", "-1", "x"])
def test_starvation_steps_is_refused_below_one(bad):
    line = ["worker", "--model", "m", "--redis-url", "redis://127.0.0.1:1/0"]
    done = CliRunner().invoke(cli, [*line, "--insecure-no-key", "--starvation-steps", bad])
    assert done.exit_code == 2 and "--starvation-steps" in done.output


def test_starvation_steps_is_in_the_help():
    shown = CliRunner().invoke(cli, ["worker", "--help"], terminal_width=200).output
    assert "--starvation-steps" in shown and "default: 8" in shown.split("--starvation-steps")[1]
