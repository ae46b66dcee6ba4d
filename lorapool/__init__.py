"""lorapool: many LoRA adapters over one base LLM, served by a Redis-queue worker pool.

The data types are torch-free and imported eagerly. The engine and the
producers are imported on first use, so that a web app that only submits
jobs never imports torch.

May import: the standard library, orjson and msgspec (the data types); the engine and
producers only lazily, through ``__getattr__``. The CLI lives in ``cli/``.

The repository's other folders are packages of this namespace: ``engine/`` is
``lorapool.engine``, and so are ``kernels``, ``worker``, ``producer``, ``audit_db``
and ``gateway``. Each one's ``__init__`` says what it is for and what it may import;
``tests/unit/test_import_rules.py`` checks those rules.
"""

from importlib import import_module

from lorapool.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from lorapool.protocol import LoRARequest, RequestOutputKind, SamplingParams
from lorapool.records.structured import GuidedDecodingParams, StructuredOutputsParams

_LAZY = {
    "LLM": "lorapool.engine.llm",
    "LLMEngine": "lorapool.engine.llm_engine",
    "EngineArgs": "lorapool.engine.config",
    "Producer": "lorapool.producer",
    "AsyncProducer": "lorapool.producer",
}

__all__ = [
    "CompletionOutput",
    "Logprob",
    "LoRARequest",
    "RequestMetrics",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "StructuredOutputsParams",
    "GuidedDecodingParams",
    *_LAZY,
]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'lorapool' has no attribute {name!r}")
    return getattr(import_module(module), name)
