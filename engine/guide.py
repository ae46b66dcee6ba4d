"""Token masks of structured outputs: one llguidance matcher per constrained sequence.

llguidance (chosen over xgrammar and outlines-core by ``benchmarks/grammar.py``:
the only one whose every random walk gave valid JSON on both tokenizers, a JSON
schema compiled in ~1 ms against 150-250 ms, ~0.1 ms a mask on SmolLM2's 49,152
tokens; RESULTS.md) compiles a request's grammar once (an LRU of prototypes,
deep-copied per sequence), and each step fills one bitmask row per constrained
sequence: bit ``t`` of row ``r`` set = token ``t`` allowed.

The step computes masks in a thread while the forward pass runs (``MaskJob``): the
mask of a sequence depends only on the tokens it has, all known before the step.
Requests without a constraint never reach this module.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from lorapool.engine.host_copy import to_device
from lorapool.grammar_limits import check_structure
from lorapool.grammar_sandbox import digest
from lorapool.records.errors import FieldError
from lorapool.records.structured import StructuredOutputsParams, check_grammar

MAX_CACHED_GRAMMARS = 128
_BITS = torch.arange(32, dtype=torch.int32)


class Guide:
    """One sequence's grammar state: which tokens may come next, advanced per token.
    ``prototype``: the compiled grammar at its start, which ``restart`` copies."""

    def __init__(self, matcher, prototype=None):
        self.matcher = matcher
        self.prototype = prototype

    def fork(self) -> Guide:
        return Guide(self.matcher.deep_copy(), self.prototype)

    def restart(self) -> Guide:
        """A fresh state at the grammar's start (a forked sample's), compiled already."""
        return Guide(self.prototype.deep_copy(), self.prototype)

    def advance(self, token_id: int) -> bool:
        """Take a sampled token; False if the grammar refuses it (or has ended)."""
        return self.matcher.consume_token(token_id)

    def fill(self, row: torch.Tensor) -> None:
        """Write the allowed-token bitmask into ``row`` (int32, contiguous, CPU)."""
        self.matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)

    @property
    def is_stopped(self) -> bool:
        """The grammar is complete and allows no further token."""
        return self.matcher.is_stopped()

    @property
    def error(self) -> str | None:
        return self.matcher.get_error() if self.matcher.is_error() else None


class GuideFactory:
    """Compiles constraints for one tokenizer; the LLTokenizer is built on first use.

    ``sandbox`` (a ``GrammarSandbox``, set by the worker): each new constraint is first
    counted against its limits and compiled in one of its processes, so that one that
    crashes llguidance's native code or runs away fails its request alone; what passed
    is then compiled here, in a pool of as many threads as the sandbox has processes
    (``submit``), never on the step's thread: the thread waits on the sandbox's pipe
    without the GIL (a 500-rule GBNF: ~0.4 s there, converted and validated), then
    llguidance compiles it here (20-80 ms, during which a busy Python thread still ran
    with gaps of at most 25 ms, measured). Without a sandbox (the offline ``LLM``), the
    default limits are counted and the grammar is validated in this process, in
    ``guide``. Prototypes are cached by the constraint's hash: a repeated grammar costs
    once."""

    sandbox = None

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids):
        self.hf_tokenizer = tokenizer
        self.vocab_size = max(vocab_size, len(tokenizer))  # mask width (bits)
        self.eos_token_ids = sorted(eos_token_ids)
        self._tokenizer = None
        self._prototypes: OrderedDict[str, object] = OrderedDict()
        self._compiling: dict[str, Future] = {}  # digest -> its compile in the pool
        self._lock = threading.Lock()  # the step's thread and the pool's share the caches
        self._building = threading.Lock()  # the LLTokenizer's one build (seconds: its own)
        self._pool: ThreadPoolExecutor | None = None

    @property
    def words(self) -> int:
        """int32 words per mask row."""
        return (self.vocab_size + 31) // 32

    def _lltokenizer(self):
        with self._building:
            if self._tokenizer is None:
                import llguidance.hf

                self._tokenizer = llguidance.hf.from_tokenizer(
                    self.hf_tokenizer, n_vocab=self.vocab_size, eos_token=self.eos_token_ids
                )
            return self._tokenizer

    def guide(self, params: StructuredOutputsParams) -> Guide:
        """A fresh Guide at the start of ``params``'s grammar, compiled on this thread if
        it is new; ValueError naming the problem when it does not compile."""
        key = digest(params)
        with self._lock:
            prototype = self._cached(key)
        if prototype is None:
            prototype = self._compile(key, params)
        return Guide(prototype.deep_copy(), prototype)

    def submit(self, params: StructuredOutputsParams) -> Future | None:
        """``params``'s compile in the pool (one future per constraint however many ask),
        which gives its prototype or raises ValueError naming the problem; None when it
        is compiled already or there is no sandbox (then ``guide`` it here)."""
        if self.sandbox is None:
            return None
        key = digest(params)
        with self._lock:
            if self._cached(key) is not None:
                return None
            future = self._compiling.get(key)
            if future is None:
                future = self._compiling[key] = self._executor().submit(self._compile, key, params)
            return future

    def warm(self) -> None:
        """Build the LLTokenizer in the background (~2 s for SmolLM2's 49,152 tokens),
        so that the first constrained request does not wait for it."""
        self._executor().submit(self._lltokenizer)

    def close(self) -> None:
        """Stop the pool (compiles not started are dropped) and the sandbox."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        if self.sandbox is not None:
            self.sandbox.close()

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:  # as many threads as the sandbox has processes
            size = getattr(self.sandbox, "size", 1)
            self._pool = ThreadPoolExecutor(size, thread_name_prefix="lorapool-grammar")
        return self._pool

    def _cached(self, key: str):
        prototype = self._prototypes.get(key)
        if prototype is not None:
            self._prototypes.move_to_end(key)
        return prototype

    def _compile(self, key: str, params: StructuredOutputsParams):
        from llguidance import LLMatcher

        try:
            matcher = LLMatcher(self._lltokenizer(), self._checked(params), log_level=0)
            if matcher.is_error():
                raise ValueError(f"structured_outputs.{params.kind}: {matcher.get_error()}")
        finally:
            with self._lock:
                self._compiling.pop(key, None)
        with self._lock:
            self._prototypes[key] = matcher
            if len(self._prototypes) > MAX_CACHED_GRAMMARS:
                self._prototypes.popitem(last=False)
        return matcher

    def _checked(self, params: StructuredOutputsParams) -> str:
        """The grammar of ``params`` once it passed the limits and a compile (in the
        sandbox when there is one); ValueError naming the limit or the problem."""
        try:
            if self.sandbox is None:
                check_structure(params)
                return check_grammar(params)
            return self.sandbox.check(params, grammar=True)  # converted out of process
        except FieldError as exc:
            raise ValueError(str(exc)) from None


# the job field a refused grammar is about: readers name the request's parameter by it
STRUCTURED = "sampling_params.structured_outputs"


def request_guide(factory: GuideFactory, request) -> Guide | None:
    """A constrained request's grammar state, past its resumed tokens (None: no
    constraint); ValueError naming the request and the problem."""
    constraint = request.params.structured_outputs
    if constraint is None:
        return None
    try:
        guide = factory.guide(constraint)
    except ValueError as exc:
        raise FieldError(f"request {request.request_id}: {exc}", field=STRUCTURED) from None
    return resume(guide, request)


def resume(guide: Guide, request) -> Guide:
    """``guide`` past ``request``'s resumed tokens; ValueError when they do not follow."""
    constraint = request.params.structured_outputs
    for token in request.resumed_token_ids:
        if not guide.advance(token):
            raise FieldError(
                f"request {request.request_id}: its resumed tokens do not follow "
                f"its structured_outputs.{constraint.kind}",
                field=STRUCTURED,
            )
    return guide


def advance_guide(seq, token_id: int) -> None:
    """``seq``'s grammar takes its sampled token; a grammar that is complete ends the
    sequence ("stop"), one that refuses the token fails the request."""
    if not seq.guide.advance(token_id):
        seq.finish_reason = seq.finish_reason or "error"
        seq.request.error = (
            f"request {seq.request.request_id}: token {token_id} broke its "
            f"structured output ({seq.guide.error or 'refused by the grammar'})"
        )
    elif seq.guide.is_stopped and seq.finish_reason is None:
        seq.finish_reason = "stop"


@dataclass
class MaskStats:
    """What structured outputs cost (for benchmarks): masks filled, the seconds filling
    them took (off the step's thread), and the seconds the step then waited for them."""

    masks: int = 0
    fill_s: float = 0.0
    wait_s: float = 0.0


@dataclass
class MaskJob:
    """The masks of one step's constrained sequences, filled off the step's thread."""

    guides: list[Guide]
    masks: torch.Tensor  # [len(guides), words] int32
    stats: MaskStats
    future: Future | None = None

    def result(self) -> torch.Tensor:
        if self.future is not None:
            start = time.perf_counter()
            self.future.result()
            self.stats.wait_s += time.perf_counter() - start
        return self.masks


class MaskPool:
    """One background thread that fills masks while the forward pass runs."""

    def __init__(self, words: int):
        self.words = words
        self.stats = MaskStats()
        self._executor: ThreadPoolExecutor | None = None

    def start(self, guides: list[Guide]) -> MaskJob:
        masks = torch.zeros((len(guides), self.words), dtype=torch.int32)
        job = MaskJob(guides, masks, self.stats)
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="lorapool-masks")
        job.future = self._executor.submit(_fill_all, guides, masks, self.stats)
        return job

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None


def start_masks(pool: MaskPool, layout) -> tuple[MaskJob, dict[int, int]] | None:
    """Start filling the masks of the step's constrained sequences that sample a token
    (``layout``: the runner's LogitsRows); (job, seq_id -> mask row), or None."""
    guides, rows = [], {}
    for entry in layout:
        seq = entry.item.seq
        if entry.sample_row is not None and seq.guide is not None:
            rows[seq.seq_id] = len(guides)
            guides.append(seq.guide)
    return (pool.start(guides), rows) if guides else None


def _fill_all(guides: list[Guide], masks: torch.Tensor, stats: MaskStats) -> None:
    start = time.perf_counter()
    for i, guide in enumerate(guides):
        guide.fill(masks[i])
    stats.masks += len(guides)
    stats.fill_s += time.perf_counter() - start


def allowed(masks: torch.Tensor, vocab: int) -> torch.Tensor:
    """The bitmask [R, W] as booleans [R, vocab] (True: allowed)."""
    bits = (masks.unsqueeze(-1) >> _BITS) & 1  # [R, W, 32]
    return bits.view(masks.shape[0], -1)[:, :vocab].bool()


def apply_masks(x: torch.Tensor, rows, fallback: torch.Tensor) -> torch.Tensor:
    """``x`` [S, V] with every constrained row's disallowed tokens at -inf (a copy when
    some row has a mask, else ``x`` itself). A row that the penalties left with no
    allowed token (min_tokens banning the EOS its grammar needs) takes its allowed
    tokens from ``fallback`` (the logits before penalties) instead."""
    constrained = [i for i, r in enumerate(rows) if r.allowed is not None]
    if not constrained:
        return x
    x = x.clone() if x is fallback else x
    idx = to_device(constrained, x.device, torch.long)
    ok = to_device(torch.stack([rows[i].allowed for i in constrained]), x.device)
    masked = x[idx].masked_fill_(~ok, float("-inf"))
    empty = ~torch.isfinite(masked).any(dim=-1)
    if bool(empty.any()):
        backup = fallback[idx].masked_fill(~ok, float("-inf"))
        masked[empty] = backup[empty]
    x[idx] = masked
    return x
