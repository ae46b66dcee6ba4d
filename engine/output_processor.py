"""Turns sampled tokens into finished checks and RequestOutputs.

Per token: append it, detokenize incrementally, check the stop conditions
(EOS, stop token ids, stop strings, max_tokens, model length), and build one
RequestOutput per request that advanced, in the request's ``output_kind``.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from lorapool.engine.detokenizer import IncrementalDetokenizer
from lorapool.engine.sequence import Request, Sequence
from lorapool.outputs import CompletionOutput, Logprob, RequestOutput
from lorapool.protocol import RequestOutputKind


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids: Iterable[int], max_model_len: int):
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len

    def start(self, seq: Sequence) -> None:
        """Give a new sequence its detokenizer.

        A resumed sequence replays the tokens it already streamed (from another
        worker) and counts their text as sent, so its stream goes on gaplessly.
        """
        params = seq.request.params
        seq.detokenizer = IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids, params)
        if seq.num_output_tokens:
            seq.detokenizer.add_tokens(seq.output_token_ids, check_stop=False)
            seq.sent_text = seq.detokenizer.take_delta(False)
            seq.num_sent_tokens = seq.num_output_tokens

    def append(
        self,
        seq: Sequence,
        token_id: int,
        logprob: float | None,
        top_logprobs: dict[int, Logprob] | None,
        now: float | None = None,
    ) -> None:
        """Add one sampled token to ``seq`` and decide whether it finished; ``now``:
        the step's time.time() (one call a step, not one a token)."""
        seq.append_token(token_id)
        if logprob is not None:
            seq.cumulative_logprob += logprob
        if top_logprobs is not None:
            seq.logprobs.append(self._decode_logprobs(top_logprobs))
        self.check_stop(seq, token_id)
        now = time.time() if now is None else now
        metrics = seq.request.metrics
        metrics.first_token_time = metrics.first_token_time or now
        metrics.last_token_time = now

    def check_stop(self, seq: Sequence, token_id: int) -> None:
        params, request = seq.request.params, seq.request
        can_stop = seq.num_output_tokens >= params.min_tokens
        stop_str = seq.detokenizer.add_tokens([token_id], check_stop=can_stop)
        if can_stop and not params.ignore_eos and token_id in self.eos_token_ids:
            self._finish(seq, "stop", None)
        elif can_stop and token_id in params.stop_token_ids:
            self._finish(seq, "stop", token_id)
        elif stop_str is not None:
            self._finish(seq, "stop", stop_str)
        elif seq.num_output_tokens >= request.max_tokens or seq.num_tokens >= self.max_model_len:
            self._finish(seq, "length", None)

    @staticmethod
    def _finish(seq: Sequence, reason: str, stop_reason: int | str | None) -> None:
        seq.finish_reason, seq.stop_reason = reason, stop_reason

    def _decode_logprobs(self, top: dict[int, Logprob]) -> dict[int, Logprob]:
        for token_id, lp in top.items():
            if lp.decoded_token is None:
                lp.decoded_token = self.tokenizer.decode([token_id])
        return top

    def make_output(self, request: Request) -> RequestOutput | None:
        """The output to stream for ``request`` now, or None (FINAL_ONLY, not finished)."""
        finished = request.is_finished
        kind = request.params.output_kind
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        completions = [self._completion(seq, kind) for seq in request.seqs]
        if finished:
            request.metrics.finished_time = time.time()
            request.metrics.num_generated_tokens = sum(s.num_output_tokens for s in request.seqs)
            request.metrics.num_cached_tokens = request.num_cached_tokens
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            prompt_logprobs=request.prompt_logprobs,
            outputs=completions,
            finished=finished,
            metrics=request.metrics,
            lora_request=request.lora_request,
            num_cached_tokens=request.num_cached_tokens,
            error=request.error,
        )

    @staticmethod
    def _completion(seq: Sequence, kind: RequestOutputKind) -> CompletionOutput:
        delta = seq.detokenizer.take_delta(seq.finish_reason is not None)
        seq.sent_text += delta
        wants_logprobs = seq.request.params.logprobs is not None
        if kind == RequestOutputKind.DELTA:
            begin = seq.num_sent_tokens
            text = delta
        else:
            begin = 0
            text = seq.sent_text
        seq.num_sent_tokens = seq.num_output_tokens
        return CompletionOutput(
            index=seq.index,
            text=text,
            token_ids=seq.token_ids[seq.num_prompt_tokens + begin :],  # only the delta copied
            cumulative_logprob=seq.cumulative_logprob if wants_logprobs else None,
            logprobs=seq.logprobs[begin:] if wants_logprobs else None,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            lora_request=seq.request.lora_request,
        )
