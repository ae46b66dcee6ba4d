"""Async output processing: a step's text and outputs made while the next step runs.

vLLM V0's ``use_async_output_proc`` (vLLM PR 7049), in one process. With
``EngineArgs.async_output_proc``, ``LLMEngine.step`` splits what follows a step's
sampling in two:

- at once, what the next step's schedule needs: each token joins its sequence, the
  checks on token ids and counts (EOS, stop token ids, max_tokens, model length), forks
  and grammar states; a sequence that finished leaves the scheduler
  (``OutputProcessor.append_id``);
- later, during the next step's forward (queued on the device; on a GPU the host
  does not wait for it): the detokenizer, stop strings and the RequestOutputs
  (``OutputProcessor.detokenize``, ``DeferredOutputs.run_deferred``).

So a step's outputs come from the ``step()`` call after it (``abort_request`` and
``fail_request`` make the deferred ones first, so that a request's last output holds all
its text), and the host's output work overlaps the device's forward instead of adding to
it. The one thing the split changes is a stop string: it is known only after the next
step was scheduled, so that step computes one more token for a sequence a stop string
ended; that token is dropped before it joins the sequence, and its charge to the tenant
is given back (``Scheduler.refund``) before the schedule after it. That one step's
admissions read the counter with it: the fair share's bound grows by at most
max_num_seqs * output_cost / w_f (``engine.scheduler_output``). The tokens, texts,
logprobs and finish reasons of every request are those of the synchronous engine (greedy
and seeded rows alike; an unseeded row draws from the sampler's generator, which that
extra row advances). Off by default, until the GPU kit has measured it (``bench gpu``'s
``flag_async_output_proc_*``); on the CPU, where torch runs each op before returning,
nothing overlaps (``benchmarks/async_output.py`` stands in for a device).
"""

from __future__ import annotations

import time

from lorapool.engine.guide import advance_guide
from lorapool.engine.scheduler_output import SchedulerOutput
from lorapool.engine.sequence import Sequence
from lorapool.outputs import RequestOutput


class DeferredOutputs:
    """LLMEngine's half of async output processing: the deferred tokens and their outputs."""

    async_output_proc: bool
    _deferred: list[tuple[Sequence, int, bool]]  # (sequence, token, can_stop) in order

    def defer(self, seq: Sequence, token_id: int, can_stop: bool) -> None:
        self._deferred.append((seq, token_id, can_stop))

    def take_argmax_later(self, entries, tokens: list[int]) -> list[RequestOutput]:
        """``LLMEngine._take_argmax``'s tokens join their sequences; their outputs wait."""
        now, appended, deferred = time.time(), [], self._deferred
        append_id = self.outputs.append_id
        for entry, token in zip(entries, tokens):
            seq = entry.item.seq
            if token >= 0 and seq.finish_reason is None:  # else a stop string ended it
                deferred.append((seq, token, append_id(seq, token, None, None, now)))
                if seq.finish_reason is not None:
                    appended.append(seq)
        self.end_appended(appended)
        return []

    def sample_later(self, targets, results, bad: set[str]) -> list[RequestOutput]:
        """``LLMEngine._sample``'s tokens join their sequences (forking them, advancing
        their grammars); their outputs wait."""
        now, appended, deferred = time.time(), [], self._deferred
        append_id = self.outputs.append_id
        for (seq, i), result in zip(targets, results):
            if bad and seq.request.request_id in bad:
                continue
            target = self._fork(seq, i) if i else seq
            token = result.token_id
            can_stop = append_id(target, token, result.logprob, result.top_logprobs, now)
            deferred.append((target, token, can_stop))
            if target.guide is not None:
                advance_guide(target, token)
            if target.finish_reason is not None:
                appended.append(target)
        self.end_appended(appended)
        return []

    def end_appended(self, seqs: list[Sequence]) -> None:
        """Sequences whose tokens just appended finished them leave the scheduler now,
        so that the next step is not scheduled with them (their outputs come later)."""
        for seq in seqs:
            if seq.finish_reason is not None and not seq.is_finished:
                self.scheduler.finish(seq)

    def run_deferred(self, running: SchedulerOutput | None = None) -> list[RequestOutput]:
        """Detokenize the tokens deferred so far, check their stop strings and make their
        requests' outputs. ``running``: the step now on the device; a sequence a stop
        string ends gets back the charge of its chunk there (its token is dropped)."""
        entries, self._deferred = self._deferred, []
        if not entries:
            return []
        outputs, collect, ended = [], {}, []
        detokenize, running_output = self.outputs.detokenize, self.outputs.running_output
        for seq, token_id, can_stop in entries:
            if detokenize(seq, token_id, can_stop):
                ended.append(seq)
            request = seq.request
            if request.params.n == 1 and seq.finish_reason is None:
                output = running_output(seq)
                if output is not None:
                    outputs.append(output)
            else:
                collect[request.request_id] = request
        if ended and running is not None:
            ids = {seq.seq_id for seq in ended}
            for item in running.scheduled:
                if item.seq.seq_id in ids:
                    self.scheduler.refund(item)
        for request in collect.values():
            output = self._collect(request)
            if output is not None:
                outputs.append(output)
        return outputs

    def flush_deferred(self) -> None:
        """Make the deferred outputs now (into the next ``step()``'s): before a request
        ends by abort or error, so that its last output holds all its text."""
        if self._deferred:
            self._pending += self.run_deferred()
