"""The public face of the output types (vLLM's import path): ``RequestOutput``,
``CompletionOutput``, ``RequestMetrics`` and ``Logprob`` live in
``lorapool.records.outputs``; this module keeps ``from lorapool.outputs import ...``
working for the seeds' code and everything written against it."""

from lorapool.records.outputs import (  # noqa: F401
    CompletionOutput,
    Logprob,
    RequestMetrics,
    RequestOutput,
    logprobs_from_wire,
    logprobs_to_wire,
    wire_head,
)
