"""Commands build their configs from their options by name (``lorapool.cli.options``)."""

import dataclasses
import inspect

import pytest

from lorapool.cli.options import config_from


@dataclasses.dataclass
class Settings:
    prefix: str
    lease_s: float = 10.0
    burst: bool = False


def test_config_takes_the_options_named_as_its_fields_and_the_given_ones():
    options = {"prefix": "p", "burst": True, "host": "h", "lease": 3.0}
    assert config_from(Settings, options, lease_s=3.0) == Settings("p", 3.0, True)


def test_a_given_value_wins_over_the_option_of_that_name():
    assert config_from(Settings, {"prefix": "p"}, prefix="q").prefix == "q"


def command_options(command) -> set[str]:
    return {param.name for param in command.params}


def fields(*classes) -> set[str]:
    return {field.name for cls in classes for field in dataclasses.fields(cls)}


@pytest.mark.parametrize("name", ["serve", "audit-writer", "worker"])
def test_every_option_reaches_a_config_or_is_used_by_name(name):
    # An option neither named as a config field nor a parameter of the command
    # would be dropped without a word.
    from lorapool.cli.main import cli

    command = cli.get_command(None, name)
    if name == "worker":
        pytest.importorskip("torch")
        from lorapool.engine.config import EngineArgs
        from lorapool.worker.config import WorkerConfig

        configs = (EngineArgs, WorkerConfig)
    elif name == "serve":
        from lorapool.gateway.config import GatewayConfig

        configs = (GatewayConfig,)
    else:
        from lorapool.audit_db.writer import WriterConfig

        configs = (WriterConfig,)
    named = {p for p in inspect.signature(command.callback).parameters if p != "options"}
    assert command_options(command) - named <= fields(*configs)
