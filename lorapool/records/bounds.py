"""The bound of every field a request carries, written once, as msgspec constraint types.

Each alias below is ``Annotated[<type>, msgspec.Meta(...)]``: msgspec enforces it when
it decodes a record typed with it (a job from Redis: ``records.job``), and
``SamplingParams``, ``LoRARequest`` and the job check Python-built values against the
same alias (``protocol``); the OpenAI request models and the gateway's OpenAPI schema
read their bounds from here too (``bounds_of`` gives a type's as keyword arguments).
What one field cannot say alone stays a small explicit check beside the record
(``min_tokens <= max_tokens``, ``top_k != 0``, a deployment's ``JobLimits``).

``explain`` words a type's bound for an error message ("in [1, 2147483647]", "at least
1"), so a message and the bound it names never disagree. Lives at the top of the
package, beneath ``protocol`` (which the lifecycle imports). Torch-free: the standard
library and msgspec.
"""

from __future__ import annotations

import sys
from typing import Annotated, Any, get_args, get_origin

from msgspec import Meta

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1  # a count's most: what every JSON writer of the wire (orjson) holds
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed takes
PENALTY_MAX = 2.0  # presence and frequency penalties lie in [-PENALTY_MAX, PENALTY_MAX] (OpenAI's)
LOGIT_BIAS_MAX = 100.0  # a token's bias lies in [-LOGIT_BIAS_MAX, LOGIT_BIAS_MAX] (OpenAI's)
MAX_LOGIT_BIAS = 1024  # entries (OpenAI allows 300)
# Stop strings: every one is looked for in each new token's text, so their number and
# length are bounded (OpenAI allows 4 strings; the gateway's max_stop, 4 by default,
# holds its OpenAI routes to fewer). Lengths count characters.
MAX_STOP = 64  # strings
MAX_STOP_CHARS = 1024  # characters in one string
MAX_STOP_TOTAL_CHARS = 8192  # characters in all of them together (a cross-field check)
MAX_LORA_NAME = 1024
MAX_REQUEST_ID = 256
MAX_RESULT_TTL_S = 366 * 24 * 3600
# a chat's messages (``lorapool.records.messages``)
MAX_MESSAGES = 4096
MAX_ROLE = 64
MAX_NAME = 256  # a message's name, a tool call's id, a function's name
MAX_TOOLS = 128
MAX_TOOL_CALLS = 128

# The largest finite float: an upper bound of ``le=FINITE`` only keeps out inf (NaN
# fails every bound), which JSON cannot carry but Python can.
FINITE = sys.float_info.max
_NO_NUL = "^[^\x00]*$"

# -- counts and token ids ---------------------------------------------------------------
Count = Annotated[int, Meta(ge=1, le=INT64_MAX)]  # n, max_tokens
NonNegative = Annotated[int, Meta(ge=0, le=INT64_MAX)]  # min_tokens, logprobs, prompt_logprobs
TokenId = Annotated[int, Meta(ge=0, le=INT32_MAX, title="token id")]  # prompt, stop, bias
TopK = Annotated[int, Meta(ge=-1, le=INT64_MAX)]  # -1: disabled; 0 refused by a check
# Seed's upper bound, SEED_MAX (2**64 - 1), lies past the int64 msgspec's bounds hold:
# the record that carries a seed checks it (``protocol.SamplingParams``).
Seed = Annotated[int, Meta(ge=SEED_MIN)]
AdapterId = Annotated[int, Meta(ge=1, le=INT32_MAX)]  # lora_int_id; 0 is the base model
ResultTtl = Annotated[int, Meta(ge=1, le=MAX_RESULT_TTL_S)]  # seconds
TokenIds = Annotated[list[TokenId], Meta(min_length=1)]  # a prompt's

# -- real numbers (finite; an int is taken as a float) ----------------------------------
Temperature = Annotated[float, Meta(ge=0.0, le=FINITE)]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
MinP = Annotated[float, Meta(ge=0.0, le=1.0)]
Penalty = Annotated[float, Meta(ge=-PENALTY_MAX, le=PENALTY_MAX)]  # presence, frequency
RepetitionPenalty = Annotated[float, Meta(gt=0.0, le=FINITE)]
LogitBias = Annotated[float, Meta(ge=-LOGIT_BIAS_MAX, le=LOGIT_BIAS_MAX)]
Seconds = Annotated[float, Meta(ge=0.0, le=FINITE)]  # arrival_time (Unix time)
LogitBiases = Annotated[dict[TokenId, LogitBias], Meta(max_length=MAX_LOGIT_BIAS)]

# -- text -------------------------------------------------------------------------------
# a request id's rule, here only: 1 to MAX_REQUEST_ID characters, none of these (braces
# would end a Redis Cluster hash tag in its keys; NUL ends strings in C clients)
REQUEST_ID_FORBIDDEN = "{}\x00"
RequestId = Annotated[
    str, Meta(min_length=1, max_length=MAX_REQUEST_ID, pattern=f"^[^{REQUEST_ID_FORBIDDEN}]*$")
]


def is_request_id(value: Any) -> bool:
    """Whether ``value`` is a request id that ``RequestId`` accepts (for a check that
    wants a yes or no, not msgspec's refusal: a URL's job id, a refused job's id)."""
    return (
        isinstance(value, str)
        and 0 < len(value) <= MAX_REQUEST_ID
        and not any(c in value for c in REQUEST_ID_FORBIDDEN)
    )


LoraName = Annotated[str, Meta(min_length=1, max_length=MAX_LORA_NAME, pattern=_NO_NUL)]
LoraPath = Annotated[str, Meta(pattern=_NO_NUL)]  # "" when the registry resolves it
StopString = Annotated[str, Meta(min_length=1, max_length=MAX_STOP_CHARS)]
StopStrings = Annotated[list[StopString], Meta(max_length=MAX_STOP)]
Role = Annotated[str, Meta(min_length=1, max_length=MAX_ROLE, pattern=_NO_NUL)]
ShortName = Annotated[str, Meta(min_length=1, max_length=MAX_NAME, pattern=_NO_NUL)]


def meta_of(tp: Any) -> Meta | None:
    """The constraint of an alias above (None for a plain type)."""
    if get_origin(tp) is Annotated:
        return next((m for m in get_args(tp)[1:] if isinstance(m, Meta)), None)
    return None


def bounds_of(tp: Any) -> dict[str, Any]:
    """The alias's bounds as keyword arguments (``ge``, ``le``, ``gt``, ``lt``,
    ``min_length``, ``max_length``, ``pattern``): what pydantic's ``Field`` and a JSON
    schema take. ``le=FINITE`` is left out (JSON numbers are finite)."""
    meta = meta_of(tp)
    names = ("ge", "le", "gt", "lt", "min_length", "max_length", "pattern")
    out = {n: v for n in names if (v := getattr(meta, n, None)) is not None}
    if out.get("le") == FINITE:
        del out["le"]
    return out


def explain(tp: Any) -> str:
    """What a value of the alias must be, for an error message: "an integer in [1,
    2147483647]", "a finite number >= 0.0", "a non-empty string of at most 256
    characters without NUL"."""
    base = get_args(tp)[0] if get_origin(tp) is Annotated else tp
    b, title = bounds_of(tp), getattr(meta_of(tp), "title", None)
    if title:
        return f"a {title} ({explain(Annotated[base, Meta(**b)])})"
    if base is int or base is float:
        bounded_above = getattr(meta_of(tp), "le", None) is not None  # FINITE included
        noun = "an integer" if base is int else "a finite number" if bounded_above else "a number"
        lo = ("(", b["gt"]) if "gt" in b else ("[", b.get("ge"))
        hi = b.get("le")
        if lo[1] is not None and hi is not None:
            return f"{noun} in {lo[0]}{lo[1]}, {hi}]"
        if lo[1] is not None:
            return f"{noun} {'>' if lo[0] == '(' else '>='} {lo[1]}"
        return noun
    if base is str:
        most = b.get("max_length")
        text = "a non-empty string" if b.get("min_length") else "a string"
        text += f" of at most {most} characters" if most else ""
        pattern = b.get("pattern", "")
        return text + (
            " without braces or NUL"
            if "{" in pattern
            else " without NUL"
            if "\x00" in pattern
            else ""
        )
    container = get_origin(base) or base
    if container in (list, dict):
        text = "a list" if container is list else "an object"
        text = f"a non-empty {text[2:]}" if b.get("min_length") else text
        items = _plural(get_args(base)[0]) if container is list and get_args(base) else ""
        most = f" at most {b['max_length']}" if "max_length" in b else ""
        return f"{text} of{most} {items}" if items else text + (f" of{most}" if most else "")
    return f"a {getattr(base, '__name__', base)}"


def _plural(item: Any) -> str:
    title = getattr(meta_of(item), "title", None)
    base = get_args(item)[0] if get_origin(item) is Annotated else item
    return f"{title}s" if title else {str: "strings", int: "integers"}.get(base, "")


__all__ = [
    "AdapterId",
    "Count",
    "FINITE",
    "INT32_MAX",
    "INT64_MAX",
    "LogitBias",
    "LogitBiases",
    "LoraName",
    "LoraPath",
    "MinP",
    "NonNegative",
    "Penalty",
    "RepetitionPenalty",
    "RequestId",
    "ResultTtl",
    "Role",
    "Seconds",
    "Seed",
    "ShortName",
    "StopString",
    "StopStrings",
    "Temperature",
    "TokenId",
    "TokenIds",
    "TopK",
    "TopP",
    "bounds_of",
    "explain",
    "meta_of",
]
