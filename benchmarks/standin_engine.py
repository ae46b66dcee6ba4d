"""The engine stand-in of ``bench queue-path`` (benchmarks/queue_gpu.py) and of the tests
that drive the real worker at GPU step rates (tests/support/standin.py): ``StandInEngine``
emits one token a running request a step, ``token_of`` is what it emits (the tests'
oracle), and it admits requests as the engine does (its KV slots)."""

from __future__ import annotations

import time
import zlib
from collections import deque

from lorapool.records.adapter import ModelIdentity

VOCAB = 49152
BASE_MODEL = ModelIdentity("stand-in", "0" * 64)
AUDIT_KEY = "lorapool-benchmark-audit-key-0123456789"


def token_of(request_id: str, position: int) -> int:
    """The stand-in's output: token ``position`` of ``request_id`` (any process, any run)."""
    return zlib.crc32(f"{request_id}:{position}".encode()) % VOCAB


class _Request:
    __slots__ = ("request_id", "prompt_len", "max_tokens", "done", "arrival", "first", "lora")

    def __init__(self, request_id, prompt_len, max_tokens, done, arrival, lora):
        self.request_id, self.prompt_len, self.max_tokens = request_id, prompt_len, max_tokens
        self.done, self.arrival, self.first, self.lora = done, arrival, None, lora


class StandInEngine:
    """A GPU engine as the worker sees it (``lorapool.worker.engine_api``).

    ``timeline``: records per step its start, end, process CPU time and running
    count, and per request the step of its first new token (for latencies).

    A step lasts ``step_s`` plus ``prefill_s`` per prefill position it runs: the
    prompt (and tokens a resumed request recomputes) of each request it admits, all in
    that step. The default, 10 µs a position, is a ~1B Llama's on an H200 (derived in
    benchmarks/tenants.py's docstring from the GPU kit's figures in RESULTS.md).
    """

    def __init__(self, max_num_seqs: int = 256, step_s: float = 0.033, prefill_s: float = 10e-6):
        self.max_num_seqs, self.step_s, self.prefill_s = max_num_seqs, step_s, prefill_s
        self.waiting: deque[_Request] = deque()
        self.running: dict[str, _Request] = {}
        self.aborted: list[_Request] = []
        self.steps: list[tuple[float, float, float, int]] = []  # start, end, cpu, running
        self.first_step: dict[str, int] = {}  # request -> step index of its first token
        self.device_name = f"stand-in ({step_s * 1000:g} ms steps)"

    # --- the worker's interface ---------------------------------------------------
    def add_request(
        self,
        request_id,
        prompt,
        params=None,
        arrival_time=None,
        lora_request=None,
        resume_token_ids=None,
        **share,
    ):
        if request_id in self.running or any(r.request_id == request_id for r in self.waiting):
            raise ValueError(f"request {request_id} is already running")
        ids = prompt.get("prompt_token_ids") if isinstance(prompt, dict) else None
        prompt_len = len(ids) if ids is not None else len(str(prompt).split())
        max_tokens = params.max_tokens if params is not None and params.max_tokens else 16
        done = len(resume_token_ids or [])
        arrival = arrival_time or time.time()
        self.waiting.append(
            _Request(request_id, prompt_len, max_tokens, done, arrival, lora_request)
        )

    def abort_request(self, request_id):
        ids = {request_id} if isinstance(request_id, str) else set(request_id)
        for rid in ids:
            request = self.running.pop(rid, None)
            if request is not None:
                self.aborted.append(request)
        self.waiting = deque(r for r in self.waiting if r.request_id not in ids)

    def expect_lora(self, lora_request, registered):
        return None  # loads no adapter files

    def has_unfinished_requests(self) -> bool:
        return bool(self.running or self.waiting or self.aborted)

    def capacity(self, ahead: int = 0) -> int:
        """The engine's rule (``engine/engine_stats.py``) for a KV cache that never runs
        out of blocks and one sequence a request: the slots neither running nor waiting
        requests hold (a request waiting for a slot does not stop the worker from
        reading into the free ones; none starves, as none is ever skipped)."""
        return max(0, self.max_num_seqs + ahead - len(self.running) - len(self.waiting))

    def request_counts(self) -> tuple[int, int]:
        return len(self.running), len(self.waiting)

    def running_request_ids(self) -> set[str]:
        return set(self.running)

    # no tokenizer, adapter slots or KV cache to report (``EngineInterface`` says how)
    def get_tokenizer(self):
        return None

    def lora_state(self) -> dict:
        return {"device": [], "cpu": [], "max_loras": 0}

    def kv_cache_usage(self) -> float | None:
        return None

    def request_limits(self) -> dict[str, int]:
        return {}

    def step_stats(self) -> dict[str, int]:
        return {}

    def cache_config(self) -> dict | None:
        return None

    def step(self) -> list:
        from lorapool.outputs import CompletionOutput, RequestMetrics, RequestOutput

        start, prefill = time.perf_counter(), 0
        while self.waiting and len(self.running) < self.max_num_seqs:
            request = self.waiting.popleft()
            self.running[request.request_id] = request
            prefill += request.prompt_len + request.done
        time.sleep(self.step_s + prefill * self.prefill_s)  # the GPU's part: the CPU is free
        index, now = len(self.steps), time.time()
        outputs = [self._final(r, "abort", now) for r in self.aborted]
        self.aborted = []
        for rid, request in list(self.running.items()):
            token = token_of(rid, request.done)
            request.done += 1
            if request.first is None:
                request.first = now
                self.first_step[rid] = index
            finished = request.done >= request.max_tokens
            completion = CompletionOutput(
                0, f" t{token}", [token], None, None, "length" if finished else None
            )
            metrics = None
            if finished:
                del self.running[rid]
                metrics = RequestMetrics(
                    request.arrival,
                    first_token_time=request.first,
                    last_token_time=now,
                    finished_time=now,
                    num_prompt_tokens=request.prompt_len,
                    num_generated_tokens=request.done,
                )
            outputs.append(
                RequestOutput(rid, None, None, None, [completion], finished, metrics, request.lora)
            )
        self.steps.append((start, time.perf_counter(), time.process_time(), len(outputs)))
        return outputs

    def _final(self, request: _Request, reason: str, now: float):
        from lorapool.outputs import CompletionOutput, RequestOutput

        completion = CompletionOutput(0, "", [], None, None, reason)
        return RequestOutput(request.request_id, None, None, None, [completion], True)

    # --- what the benchmark reads -------------------------------------------------
    def full_batch_stats(self) -> dict[str, float]:
        """Steady state: every step from the first to the last that ran a full batch
        (while the queue still had work). Steps/s, tokens/s, CPU seconds and how full
        the batch was on average (requests admitted a step late show there)."""
        full = [i for i, s in enumerate(self.steps) if s[3] >= self.max_num_seqs]
        if len(full) < 3:
            return {"steps": len(full), "steps_per_s": 0.0, "tokens": 0, "cpu_s": 0.0}
        first, last = full[0], full[-1]
        span = self.steps[last][0] - self.steps[first][0]
        tokens = sum(s[3] for s in self.steps[first + 1 : last + 1])
        gaps = sorted(
            self.steps[i + 1][0] - self.steps[i][1] for i in range(first, last)
        )  # the worker's time between one step's end and the next one's start
        return {
            "gap_ms_p50": 1000 * gaps[len(gaps) // 2],
            "gap_ms_p99": 1000 * gaps[int(len(gaps) * 0.99)],
            "gap_ms_mean": 1000 * sum(gaps) / len(gaps),
            "step_ms_mean": 1000 * sum(s[1] - s[0] for s in self.steps[first:last]) / len(gaps),
            "steps": last - first,
            "steps_per_s": (last - first) / span,
            "tokens_per_s": tokens / span,
            "occupancy": tokens / ((last - first) * self.max_num_seqs),
            "tokens": tokens,
            "cpu_s": self.steps[last][2] - self.steps[first][2],
        }
