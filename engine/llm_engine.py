"""LLMEngine: vLLM's step-driven engine API over our scheduler and model runner.

Isolation (what one request's data can do to another's output): nothing.

- Adapter weights holding NaN or Inf are refused at load (``lora.adapter``:
  AdapterError naming the adapter and tensor); its requests fail, others run.
- Attention reads only positions inside each sequence's own context: block
  tails, padding entries of a block table and freed blocks (which keep what
  their last request wrote, NaN and Inf included) are selected away, never
  multiplied by a zero mask, in the reference (``kernels.reference``) and in
  the Triton kernel (``kernels.attention_ops``).
- A request whose logits turn non-finite (finite weights that overflow, say)
  ends alone with finish_reason "error" and a message saying so
  (``_fail_non_finite``: the greedy path's argmax and the sampler give such a row
  token -1); its blocks are freed and the step's other rows are sampled as usual.

Tested in tests/engine/test_non_finite_logits.py (the whole cache filled with
NaN or Inf; an overflowing and a NaN adapter next to clean requests, which equal
their solo runs in that batch and the next) and tests/kernels/test_attention_ops.py.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterable
from typing import Any

import torch
from transformers import AutoTokenizer

from lorapool.engine.async_output import DeferredOutputs
from lorapool.engine.async_scheduling import PipelinedSteps
from lorapool.engine.block_manager import BlockManager
from lorapool.engine.config import EngineArgs
from lorapool.engine.engine_adapters import EngineAdapters
from lorapool.engine.engine_stats import EngineStats
from lorapool.engine.fair_share import check_share
from lorapool.engine.grammar_wait import GrammarWait
from lorapool.engine.guide import GuideFactory, MaskPool, advance_guide, allowed, start_masks
from lorapool.engine.host_copy import to_device
from lorapool.engine.input_processor import InputLimits, InputProcessor
from lorapool.engine.loader import eos_token_ids
from lorapool.engine.logprobs import prompt_logprobs
from lorapool.engine.lora.manager import LoRAManager
from lorapool.engine.model_runner import LogitsRows, ModelRunner
from lorapool.engine.output_processor import OutputProcessor
from lorapool.engine.sampler import (
    Sampler,
    SamplingRow,
    argmax_only,
    argmax_rows,
    finite_argmax,
)
from lorapool.engine.scheduler import Scheduler, SchedulerOutput
from lorapool.engine.sequence import Request, Sequence, SequenceStatus
from lorapool.outputs import RequestOutput
from lorapool.protocol import LoRARequest, SamplingParams

logger = logging.getLogger(__name__)


class LLMEngine(EngineStats, EngineAdapters, DeferredOutputs, PipelinedSteps):
    """Continuous-batching engine: ``add_request`` any time, ``step`` to advance all."""

    def __init__(self, args: EngineArgs):
        self.args = args
        self.runner = ModelRunner(args)
        self.tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.model)
        model_len = self.runner.max_model_len
        self.max_model_len = min(args.max_model_len or model_len, model_len)
        self.block_manager = BlockManager(
            self.runner.num_blocks, args.block_size, args.enable_prefix_caching
        )
        self.scheduler = Scheduler(args.scheduler_config(), self.block_manager)
        self.eos_token_ids = eos_token_ids(args.model, self.runner.hf_config, self.tokenizer)
        self.sampler = Sampler(self.eos_token_ids, seed=args.seed)
        self.inputs = InputProcessor(
            self.tokenizer,
            InputLimits(
                vocab_size=self.runner.model.vocab_size,
                max_model_len=self.max_model_len,
                kv_capacity_tokens=self.block_manager.capacity_tokens,
                max_logprobs=args.max_logprobs,
                enable_lora=args.enable_lora,
            ),
        )
        self.outputs = OutputProcessor(self.tokenizer, self.eos_token_ids, self.max_model_len)
        self.guides = GuideFactory(self.tokenizer, self.runner.model.vocab_size, self.eos_token_ids)
        self.mask_pool = MaskPool(self.guides.words)
        self.grammars = GrammarWait(self.guides)  # requests whose grammar compiles
        self._num_guided = 0  # live requests with a structured output
        self.num_step_tokens = 0  # tokens the last step ran (prompt and generated)
        self.requests: dict[str, Request] = {}
        self._seq_ids = itertools.count()
        self._pending: list[RequestOutput] = []
        self.async_output_proc = args.async_output_proc  # engine.async_output
        self._deferred = []
        self.async_scheduling, self._in_flight = args.async_scheduling, None
        self.lora_manager = (
            LoRAManager(self.runner.model, args, self.runner.device, self.runner.dtype)
            if args.enable_lora
            else None
        )
        loras = self.lora_manager
        lora = (loras.step, loras.max_loras, loras.max_rank) if loras is not None else None
        self.runner.capture_graphs(args, lora)  # after the LoRA layers are in the model

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> LLMEngine:
        return cls(engine_args)

    def get_tokenizer(self):
        return self.tokenizer

    def add_request(
        self,
        request_id: str,
        prompt: str | dict[str, Any],
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
        resume_token_ids: list[int] | None = None,
        *,
        priority: int = 0,
        tenant: str | None = None,
        tenant_weight: float | None = None,
        **kwargs: Any,
    ) -> None:
        """Queue a request; raises ValueError naming the problem if it is invalid.

        ``resume_token_ids``: tokens this request already generated and streamed
        elsewhere (a failed-over worker); generation continues after them, and
        seeded sampling continues as if it had never stopped. ``priority`` (vLLM's),
        ``tenant``, ``tenant_weight``: ``engine.fair_share``."""
        if request_id in self.requests:
            raise ValueError(f"request {request_id} is already running")
        share = check_share(priority, tenant, tenant_weight)
        request = self.inputs.process(
            request_id, prompt, params, lora_request, arrival_time, resume_token_ids
        )
        request.priority, request.tenant, request.weight = share
        tokens = request.prompt_token_ids + request.resumed_token_ids
        seq = Sequence(next(self._seq_ids), request, 0, tokens)
        compiling = self._guide(seq)
        request.device_only = not request.guided  # ``Sampler.on_device``
        one = request.params.n == 1
        request.argmax_only = argmax_only(request.params) and not request.guided and one
        request.seqs.append(seq)
        self.outputs.start(seq)
        if not compiling:  # else scheduled once its grammar compiled (``grammar_wait``)
            self.scheduler.add(seq)
        self.requests[request_id] = request

    def _guide(self, seq: Sequence) -> bool:
        compiling = self.grammars.start(seq)
        if seq.request.params.structured_outputs is not None:
            self._num_guided += 1
            seq.request.guided = True
        return compiling

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Stop requests now; each gets a final output with finish_reason 'abort'."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        self.flush_in_flight()
        self.flush_deferred()
        for rid in ids:
            request = self._pop(rid)
            if request is not None:
                self._end_request(request, "abort")

    def fail_request(self, request_id: str, error: str) -> None:
        """End a request with finish_reason 'error' and the error text."""
        self.flush_in_flight()
        self.flush_deferred()
        request = self._pop(request_id)
        if request is not None:
            request.error = error
            self._end_request(request, "error")

    def _pop(self, request_id: str) -> Request | None:
        request = self.requests.pop(request_id, None)
        if request is not None and request.guided:
            self._num_guided -= 1
            self.grammars.drop(request_id)
        return request

    def _end_request(self, request: Request, reason: str) -> None:
        while len(request.seqs) < request.params.n:  # samples that never forked end too
            child = Sequence(
                next(self._seq_ids), request, len(request.seqs), request.prompt_token_ids
            )
            self.outputs.start(child)
            child.status = SequenceStatus.FINISHED
            child.finish_reason = reason
            request.seqs.append(child)
        for seq in request.seqs:
            if not seq.is_finished:
                seq.finish_reason = seq.finish_reason or reason
                self.scheduler.finish(seq)
        output = self.outputs.make_output(request)
        if output is not None:
            self._pending.append(output)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests or self._pending)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def step(self) -> list[RequestOutput]:
        """Run one scheduled batch; returns the outputs of the requests that advanced."""
        self.grammars.admit(self.scheduler, self.fail_request)
        outputs, self._pending = self._pending, []
        if not self.scheduler.has_unfinished():
            return outputs + self.land(None) + self.run_deferred()
        self.hold_places()  # engine.async_scheduling: the step in flight's sequences
        scheduled = self.scheduler.schedule()
        self.num_step_tokens = scheduled.num_batched_tokens
        if self.lora_manager is not None:
            self._activate_loras(scheduled)
            outputs, self._pending = outputs + self._pending, []
        if scheduled.is_empty:
            return outputs + self.land(None) + self.run_deferred()
        self._mark_scheduled(scheduled)
        self.runner.copy_blocks(scheduled.blocks_to_copy)
        slot_of = self.lora_manager.slot_of if self.lora_manager is not None else None
        batch, layout = self.runner.prepare(scheduled, self.block_manager, slot_of)
        self.fill_places(batch, scheduled)
        if self.lora_manager is not None:
            self.lora_manager.set_step_for(scheduled, self.runner.device)
        masks = start_masks(self.mask_pool, layout) if self._num_guided else None
        logits = self.runner.execute(batch)  # the masks are filled meanwhile
        sampled = argmax_rows(layout)
        if self.async_scheduling:
            return outputs + self.pipelined(scheduled, layout, logits, sampled, masks)
        self.scheduler.postprocess(scheduled)
        if sampled is not None:  # argmax and finite check queued after the forward
            queued = finite_argmax(logits)
            outputs += self.run_deferred(scheduled)  # async output: while the device runs
            tokens = queued.tolist()  # the step's one device-to-host copy
            return outputs + self._take_argmax(logits, tokens, layout, sampled)
        outputs += self.run_deferred(scheduled)
        outputs += self._process_logits(logits, layout, masks)
        return outputs

    def _mark_scheduled(self, scheduled: SchedulerOutput) -> None:
        now = time.time()
        for item in scheduled.scheduled:
            metrics = item.seq.request.metrics
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = now
                metrics.time_in_queue = now - metrics.arrival_time
                item.seq.request.num_cached_tokens = item.start  # served by the prefix cache

    def _process_logits(
        self, logits: torch.Tensor, layout: list[LogitsRows], masks=None
    ) -> list[RequestOutput]:
        """Sample the step's tokens; the outputs of the requests that advanced."""
        seqs, logit_rows = [], []
        for entry in layout:
            seq = entry.item.seq
            if len(entry.prompt_rows):
                self._prompt_logprobs(seq.request, entry, logits)
            if entry.sample_row is not None and seq.finish_reason is None:  # engine.async_output
                seqs.append(seq)
                logit_rows.append(entry.sample_row)
        if not seqs:
            return []
        return self._sample(logits, seqs, logit_rows, masks)

    def _take_argmax(self, logits, tokens: list[int], layout, entries: list[LogitsRows]):
        """The greedy fast path: ``tokens`` per logits row, -1 where the row is not
        finite; ``entries``: the layout's sampling ones (``argmax_rows``). Each
        sequence is a request of its own (n == 1), so its output is made as soon as
        its token is in."""
        if len(entries) != len(tokens):  # prompt logprobs rows, or entries sampling none
            for entry in layout:
                if len(entry.prompt_rows):
                    self._prompt_logprobs(entry.item.seq.request, entry, logits)
            tokens = [tokens[entry.sample_row] for entry in entries]
        if -1 in tokens:
            bad = {e.item.seq.request.request_id for e, t in zip(entries, tokens) if t < 0}
            self._fail_non_finite(bad)
        if self.async_output_proc:
            return self.take_argmax_later(entries, tokens)
        outputs, now = [], time.time()
        append, running_output = self.outputs.append, self.outputs.running_output
        for entry, token in zip(entries, tokens):
            if token >= 0:
                seq = entry.item.seq
                append(seq, token, None, None, now)
                if seq.finish_reason is None:
                    output = running_output(seq)
                else:
                    output = self._collect(seq.request)
                if output is not None:
                    outputs.append(output)
        return outputs

    def _sample(self, logits, seqs, logit_rows, masks) -> list[RequestOutput]:
        rows, targets, sample_rows = [], [], []
        if masks is not None:
            job, mask_of = masks
            ok = allowed(job.result(), logits.shape[1])
        of_tokens = SamplingRow.of_tokens
        for seq, logit_row in zip(seqs, logit_rows):
            params = seq.request.params
            num = params.n if seq.request.needs_fork else 1
            mask = None if seq.guide is None else ok[mask_of[seq.seq_id]]
            for i in range(num):
                row = of_tokens(params, seq.token_ids, seq.num_prompt_tokens, seq.index + i, mask)
                rows.append(row)
                targets.append((seq, i))
                sample_rows.append(logit_row)
        if sample_rows != list(range(logits.shape[0])):  # a decode step samples each row once
            logits = logits[to_device(sample_rows, logits.device, torch.long)]
        results = self.sampler(logits, rows)
        bad = {seq.request.request_id for (seq, _), r in zip(targets, results) if r.token_id < 0}
        if bad:
            self._fail_non_finite(bad)
        if self.async_output_proc:
            return self.sample_later(targets, results, bad)
        appended, append, now = [], self.outputs.append, time.time()
        for (seq, i), result in zip(targets, results):
            if bad and seq.request.request_id in bad:
                continue
            target = self._fork(seq, i) if i else seq
            append(target, result.token_id, result.logprob, result.top_logprobs, now)
            if target.guide is not None:
                advance_guide(target, result.token_id)
            appended.append(target)
        return self._outputs_after(appended)

    def _outputs_after(self, seqs: list[Sequence]) -> list[RequestOutput]:
        """The outputs of the requests whose sequences ``seqs`` just took a token: a
        single sequence that goes on makes its own; the others one per request."""
        outputs, collect, running_output = [], {}, self.outputs.running_output
        for seq in seqs:
            request = seq.request
            if request.params.n == 1 and seq.finish_reason is None:
                output = running_output(seq)
                if output is not None:
                    outputs.append(output)
            else:
                collect[request.request_id] = request
        for request in collect.values():
            output = self._collect(request)
            if output is not None:
                outputs.append(output)
        return outputs

    def _fail_non_finite(self, bad: set[str]) -> None:
        for request_id in bad:
            request = self.requests.get(request_id)
            done = 0 if request is None else sum(len(s.output_token_ids) for s in request.seqs)
            self.fail_request(
                request_id,
                f"request {request_id}: the model's logits became non-finite (NaN or Inf) "
                f"after {done} generated tokens; its adapter or input overflows in this dtype",
            )

    def _fork(self, parent: Sequence, index: int) -> Sequence:
        request = parent.request
        child = Sequence(next(self._seq_ids), request, index, request.prompt_token_ids)
        if parent.guide is not None:  # forks happen before the first token: a fresh state
            child.guide = parent.guide.restart()
        request.seqs.append(child)
        self.outputs.start(child)
        self.scheduler.fork(parent, child)
        return child

    def _prompt_logprobs(self, request: Request, entry: LogitsRows, logits: torch.Tensor) -> None:
        start, count = entry.item.start, len(entry.prompt_rows)
        existing = request.prompt_logprobs or []
        if len(existing) >= start + count + 1:
            return  # computed before this sequence was preempted
        ids = request.prompt_token_ids[start : start + count + 1]
        chunk = logits[entry.prompt_rows.start : entry.prompt_rows.stop]
        values = prompt_logprobs(chunk, ids, request.params.prompt_logprobs)
        for position in values:
            if position is not None:
                self.outputs._decode_logprobs(position)
        request.prompt_logprobs = existing + (values if start == 0 else values[1:])

    def _collect(self, request: Request) -> RequestOutput | None:
        for seq in request.seqs:
            if seq.finish_reason is not None and not seq.is_finished:
                self.scheduler.finish(seq)
        output = self.outputs.make_output(request)
        if output.finished if output is not None else request.is_finished:
            self._pop(request.request_id)
        return output
