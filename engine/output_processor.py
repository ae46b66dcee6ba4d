"""Turns sampled tokens into finished checks and RequestOutputs.

Per token: append it, detokenize incrementally, check the stop conditions
(EOS, stop token ids, stop strings, max_tokens, model length), and build one
RequestOutput per request that advanced, in the request's ``output_kind``.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from lorapool.engine.detokenizer import CachedDecode, IncrementalDetokenizer, make_decode
from lorapool.engine.sequence import Request, Sequence
from lorapool.outputs import CompletionOutput, Logprob, RequestOutput
from lorapool.protocol import RequestOutputKind


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids: Iterable[int], max_model_len: int):
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self._decoders: dict[tuple, CachedDecode] = {}  # per decode option

    def start(self, seq: Sequence) -> None:
        """Give a new sequence its detokenizer.

        A resumed sequence replays the tokens it already streamed (from another
        worker) and counts their text as sent, so its stream goes on gaplessly.
        """
        params = seq.request.params
        seq.detokenizer = IncrementalDetokenizer(
            self.tokenizer, seq.prompt_token_ids, params, self._decoder(params)
        )
        if seq.num_output_tokens:
            seq.detokenizer.add_tokens(seq.output_token_ids, check_stop=False)
            seq.sent_text = seq.detokenizer.take_delta(False)
            seq.num_sent_tokens = seq.num_output_tokens

    def _decoder(self, params) -> CachedDecode:
        key = (params.skip_special_tokens, params.spaces_between_special_tokens)
        decoder = self._decoders.get(key)
        if decoder is None:
            decoder = self._decoders[key] = CachedDecode(make_decode(self.tokenizer, params))
        return decoder

    def append(self, seq: Sequence, token_id: int, *rest) -> None:
        """Add one sampled token to ``seq`` and decide whether it finished (EOS, stop
        token ids, stop strings, max_tokens, model length): ``append_id`` (``rest``: its
        logprob, top_logprobs and now), then ``detokenize``."""
        self.detokenize(seq, token_id, self.append_id(seq, token_id, *rest))

    def append_id(
        self,
        seq: Sequence,
        token_id: int,
        logprob: float | None,
        top_logprobs: dict[int, Logprob] | None,
        now: float | None = None,
    ) -> bool:
        """``append`` but the text: the token joins ``seq`` and the checks on token ids
        and counts decide whether it finished (EOS, stop token ids, max_tokens, model
        length); ``now``: the step's time.time() (one call a step, not one a token).
        Returns whether a stop string may end it at this token (min_tokens reached),
        what ``detokenize`` then needs."""
        token_ids = seq.token_ids
        token_ids.append(token_id)
        if logprob is not None:
            seq.cumulative_logprob += logprob
        if top_logprobs is not None:
            seq.logprobs.append(self._decode_logprobs(top_logprobs))
        request = seq.request
        params = request.params
        num_output = len(token_ids) - seq.num_prompt_tokens
        can_stop = num_output >= params.min_tokens
        if can_stop and not params.ignore_eos and token_id in self.eos_token_ids:
            self._finish(seq, "stop", None)
        elif can_stop and token_id in params.stop_token_ids:
            self._finish(seq, "stop", token_id)
        elif num_output >= request.max_tokens or len(token_ids) >= self.max_model_len:
            self._finish(seq, "length", None)
        metrics = request.metrics
        metrics.last_token_time = now = time.time() if now is None else now
        if metrics.first_token_time is None:
            metrics.first_token_time = now
        return can_stop

    def detokenize(self, seq: Sequence, token_id: int, can_stop: bool) -> bool:
        """The text half of ``append``, for the token ``append_id`` last gave ``seq``
        (or later, in the order given: async output processing): its text, and whether
        a stop string ends the sequence there. A stop string comes after EOS and stop
        token ids but before the length, as vLLM checks them. True when it ended a
        sequence that had not finished."""
        stop_str = seq.detokenizer.add_token(token_id, can_stop)
        if stop_str is None or seq.finish_reason not in (None, "length"):
            return False
        ended = seq.finish_reason is None
        self._finish(seq, "stop", stop_str)
        return ended

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
            metrics = request.metrics
            metrics.finished_time = time.time()
            metrics.num_generated_tokens = sum(s.num_output_tokens for s in request.seqs)
            metrics.num_cached_tokens = request.num_cached_tokens
        return self._output(request, completions, finished)

    def running_output(self, seq: Sequence) -> RequestOutput | None:
        """``make_output`` of a request of one sequence that goes on (no finish reason)."""
        kind = seq.request.params.output_kind
        if kind == RequestOutputKind.FINAL_ONLY:
            return None
        return self._output(seq.request, [self._completion(seq, kind)], False)

    @staticmethod
    def _output(request: Request, completions: list[CompletionOutput], finished: bool):
        output = RequestOutput(  # positional: a step builds one per running request
            request.request_id,
            request.prompt,
            request.prompt_token_ids,
            request.prompt_logprobs,
            completions,
            finished,
            request.metrics,
            request.lora_request,
            None,
            None,
            request.num_cached_tokens,
        )
        output.error = request.error
        return output

    @staticmethod
    def _completion(seq: Sequence, kind: RequestOutputKind) -> CompletionOutput:
        delta = seq.detokenizer.take_delta(seq.finish_reason is not None)
        wants_logprobs = seq.request.params.logprobs is not None
        if kind == RequestOutputKind.DELTA:  # sent_text is not kept: no copy of the whole text
            begin = seq.num_sent_tokens
            text = delta
        else:
            seq.sent_text += delta
            begin = 0
            text = seq.sent_text
        seq.num_sent_tokens = len(seq.token_ids) - seq.num_prompt_tokens
        return CompletionOutput(
            seq.index,
            text,
            seq.token_ids[seq.num_prompt_tokens + begin :],  # only the delta is copied
            seq.cumulative_logprob if wants_logprobs else None,
            seq.logprobs[begin:] if wants_logprobs else None,
            seq.finish_reason,
            seq.stop_reason,
            seq.request.lora_request,
        )
