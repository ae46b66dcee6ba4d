"""``EngineInterface`` is the whole of what the worker asks of an engine, and both
engines it drives implement all of it: ``LLMEngine`` and the stand-in of
``bench queue-path`` and the tests (``benchmarks/standin_engine.py``). Checked by
name and by the arguments the worker passes (the worker probes for no method)."""

import inspect

import pytest
from standin import load

from lorapool.worker.engine_api import EngineInterface

SURFACE = sorted(
    name
    for name, value in vars(EngineInterface).items()
    if not name.startswith("_") and callable(value)
)


def engines():
    from lorapool.engine.llm_engine import LLMEngine

    return [LLMEngine, load().StandInEngine]


def test_the_interface_names_the_reads_the_worker_once_probed_for():
    assert {"get_tokenizer", "lora_state", "kv_cache_usage"} <= set(SURFACE)
    assert {"add_request", "step", "abort_request", "capacity"} <= set(SURFACE)


@pytest.mark.parametrize("engine", engines(), ids=lambda e: e.__name__)
def test_an_engine_implements_every_method_the_worker_calls(engine):
    for name in SURFACE:
        method = getattr(engine, name, None)
        assert callable(method), f"{engine.__name__} lacks {name}"
        wanted = inspect.signature(getattr(EngineInterface, name)).parameters
        given = inspect.signature(method).parameters
        for param in wanted:  # every argument the interface names, the engine takes
            assert param in given or any(
                p.kind is inspect.Parameter.VAR_KEYWORD for p in given.values()
            ), f"{engine.__name__}.{name} takes no {param}"


def test_an_engine_names_its_device():
    from lorapool.engine.llm_engine import LLMEngine

    assert set(EngineInterface.__annotations__) == {"device_name"}
    assert isinstance(inspect.getattr_static(LLMEngine, "device_name"), property)
    assert isinstance(load().StandInEngine().device_name, str)
