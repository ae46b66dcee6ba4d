"""The public face of the request-side types (vLLM's import path): ``SamplingParams``,
``LoRARequest`` and ``RequestOutputKind`` live in ``lorapool.records.params``; this
module keeps ``from lorapool.protocol import ...`` working for the seeds' code and
everything written against it."""

from lorapool.records.bounds import (  # noqa: F401
    MAX_STOP,
    MAX_STOP_CHARS,
    MAX_STOP_TOTAL_CHARS,
    PENALTY_MAX,
)
from lorapool.records.errors import FieldError, check, short_repr  # noqa: F401
from lorapool.records.params import (  # noqa: F401
    FINISH_REASONS,
    WIRE_VERSION,
    LoRARequest,
    RequestOutputKind,
    SamplingParams,
    is_int,
    with_token_keys,
)
