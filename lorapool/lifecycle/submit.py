"""Submitting: a job built and validated from what a caller gives (the prompt forms
vLLM takes), its completion callback checked, and SUBMIT, which enqueues it only if its
request id is new."""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from lorapool.connection import is_async_client, register_script, run_scripts, run_scripts_async
from lorapool.lifecycle.keys import Keys
from lorapool.protocol import FieldError, LoRARequest, SamplingParams
from lorapool.records.job import Job, JobLimits, encode_job, job_from_dict

# Enqueue a job only if its request id is new: the marker and the entry together.
# The same call sent again (redis-py retries one whose reply was lost) finds its own
# marker ('submitted' is this call's clock reading) and returns its entry.
# A request id whose run key exists (only workers write it: lifecycle/run_state.py) is
# taken too, marker or not: a run ended (or a worker ended it for its readers) is never
# run again under its id while its result lives.
# KEYS: job marker, the stream of the job's priority.
# ARGV: payload, output kind, now, priority, on_finish ('' none: see ``check_on_finish``),
# its run key (only read: in ARGV, for Redis checks a script's declared keys as read and
# written, and a producer may only read it; it is in the marker's slot).
SUBMIT_SCRIPT = """
if redis.call('EXISTS', KEYS[1]) == 1 then
  if redis.call('HGET', KEYS[1], 'submitted') == ARGV[3] then
    return redis.call('HGET', KEYS[1], 'entry')
  end
  return false
end
if redis.call('EXISTS', ARGV[6]) == 1 then return false end
local entry = redis.call('XADD', KEYS[2], '*', 'data', ARGV[1])
redis.call('HSET', KEYS[1], 'status', 'queued', 'entry', entry,
           'output_kind', ARGV[2], 'submitted', ARGV[3], 'priority', ARGV[4])
if ARGV[5] ~= '' then redis.call('HSET', KEYS[1], 'on_finish', ARGV[5]) end
return entry
"""


def submit_call(keys: Keys, job: Job, priority: str, on_finish: str) -> dict[str, list]:
    """The keys and args of ``SUBMIT_SCRIPT`` for ``job`` (its marker and its shard's
    stream of ``priority``): the script's KEYS/ARGV contract, written out here only."""
    rid = job.request_id
    return {
        "keys": [keys.job(rid), keys.for_request(rid).stream(priority)],
        "args": [
            encode_job(job),
            job.sampling_params.output_kind.value,
            time.time(),
            priority,
            on_finish,
            keys.run(rid),
        ],
    }


class Submit:
    """``submit(jobs, priority, on_finish)``: SUBMIT of each job, pipelined (one round
    trip on a standalone Redis, one per node on a cluster); each job's entry id, or None
    where its request id existed. Awaitable on a redis.asyncio client."""

    def __init__(self, connection, keys: Keys):
        self.connection, self.keys = connection, keys
        self._script = register_script(connection, SUBMIT_SCRIPT)
        self._run = run_scripts_async if is_async_client(connection) else run_scripts

    def __call__(self, jobs: list[Job], priority: str, on_finish: str):
        calls = [submit_call(self.keys, job, priority, on_finish) for job in jobs]
        return self._run(self.connection, self._script, calls)


ON_FINISH_FUNCTION = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+")
MAX_ON_FINISH = 2048


def check_on_finish(value: Any) -> str:
    """A job's completion callback as stored in its marker ('' for none): the dotted
    path of a function for an RQ job (``myapp.tasks.handle_result``), or an http(s)
    URL for a webhook. Raises FieldError naming what is wrong."""
    if value is None:
        return ""
    if not isinstance(value, str):
        raise FieldError(f"on_finish must be a string, got {type(value).__name__}")
    if len(value) > MAX_ON_FINISH or any(ord(c) < 33 or ord(c) == 127 for c in value):
        raise FieldError(
            f"on_finish must be at most {MAX_ON_FINISH} printable characters without spaces"
        )
    url = urlsplit(value)
    if url.scheme in ("http", "https") and url.netloc:
        return value
    if ON_FINISH_FUNCTION.fullmatch(value):
        return value
    raise FieldError(
        f"on_finish must be a dotted function path (myapp.tasks.handle_result) or an "
        f"http(s) URL, got {value[:80]!r}"
    )


def build_job(
    prompt: Any,
    params: SamplingParams | None,
    lora: LoRARequest | None,
    request_id: str | None,
    metadata: dict | None,
    limits: JobLimits | None = None,
    result_ttl_s: int | None = None,
) -> Job:
    """A validated Job, by the workers' own check (``job_from_dict``).

    Raises FieldError (a ValueError) naming the field and the value.
    """
    params = SamplingParams() if params is None else params
    if not isinstance(params, SamplingParams):
        raise FieldError(f"params must be SamplingParams, got {type(params).__name__}")
    params.verify()  # fields may have been changed after construction
    if lora is not None:
        if not isinstance(lora, LoRARequest):
            raise FieldError(f"lora_request must be a LoRARequest, got {type(lora).__name__}")
        lora.verify()
    text, ids, messages = _prompt(prompt)
    tools = prompt.get("tools") if isinstance(prompt, Mapping) and messages is not None else None
    data = {
        "request_id": uuid.uuid4().hex if request_id is None else request_id,
        "prompt": text,
        "prompt_token_ids": ids,
        "sampling_params": params.to_dict(),
        "lora_request": None if lora is None else lora.to_dict(),
        "metadata": metadata,
        "arrival_time": time.time(),
        "result_ttl_s": result_ttl_s,
        "messages": messages,
        **({} if tools is None else {"tools": tools}),
    }
    return job_from_dict(data, limits)


def _prompt(prompt: Any) -> tuple[Any, Any, Any]:
    """Text, token ids and chat messages of the prompt forms vLLM takes, and
    ``{"messages": [...]}`` for a chat, optionally with its ``"tools"`` (job_from_dict
    checks them)."""
    if isinstance(prompt, Mapping) and "messages" in prompt:
        return None, None, prompt["messages"]
    if isinstance(prompt, Mapping) and "prompt_token_ids" in prompt:
        ids = prompt["prompt_token_ids"]
        return prompt.get("prompt"), list(ids) if isinstance(ids, tuple) else ids, None
    if isinstance(prompt, Mapping) and "prompt" in prompt:
        return _prompt(prompt["prompt"])
    if isinstance(prompt, str):
        return prompt, None, None
    raise FieldError(
        "prompt must be a string, {'prompt_token_ids': [...]} or {'messages': [...]}, "
        f"got {type(prompt).__name__}"
    )
