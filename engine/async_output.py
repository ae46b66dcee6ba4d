"""Async output processing: a step's text and outputs made while the next step runs.

vLLM V0's ``use_async_output_proc`` (vLLM PR 7049), in one process. With
``EngineArgs.async_output_proc``, ``LLMEngine.step`` splits what follows a step's
sampling in two:

- at once, what the next step's schedule needs: each token joins its sequence, the
  checks on token ids and counts (EOS, stop token ids, max_tokens, model length), forks
  and grammar states; a sequence that finished leaves the scheduler
  (``OutputProcessor.append_id``);
- later, during the next step's forward (queued on the device; on a GPU the host
  does not wait for it): the detokenizer, stop strings and the RequestOutputs of the
  tokens of sequences that go on past their first one (``OutputProcessor.detokenize``,
  ``DeferredOutputs.run_deferred``).

What a caller waits on is not delayed: a request's first token and its end by token ids
or length come from the step that sampled them (their outputs made at once, as without
async output), so the time to first token and a short request's latency do not grow; the
tokens between come from the ``step()`` call after theirs, and the host's work for them
overlaps the device's forward instead of adding to it. (Deferring them all, as a first
version did, made a one-token request beside a flood of n=64 samples wait a whole step
more: benchmarks/RESULTS.md.) A request of n > 1 defers all its outputs (one output
covers its n sequences). ``abort_request`` and ``fail_request`` make the deferred
outputs first, so that a request's last output holds all its text.

The one thing the split changes is a stop string on a deferred token: it is known only
after the next step was scheduled, so that step computes one more token for the
sequence it ended; that token is dropped before it joins the sequence, and its charge
to the tenant is given back (``Scheduler.refund``) before the schedule after it. That
one step's admissions read the counter with it: the fair share's bound grows by at most
max_num_seqs * output_cost / w_f (``engine.scheduler_output``). The tokens, texts,
logprobs and finish reasons of every request are those of the synchronous engine
(greedy and seeded rows alike; an unseeded row draws from the sampler's generator,
which that extra row advances). Off by default, until the GPU kit has measured it
(``bench gpu``'s ``flag_async_output_proc_*``); on the CPU, where torch runs each op
before returning, nothing overlaps (``benchmarks/async_output.py`` stands in for a
device).
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

    def take_argmax_later(self, entries, tokens: list[int]) -> list[RequestOutput]:
        """``LLMEngine._take_argmax``'s tokens join their sequences; the outputs of those
        that go on past their first token wait, the others' are made now."""
        now, at_once = time.time(), []
        append_id, deferred = self.outputs.append_id, self._deferred
        for entry, token in zip(entries, tokens):
            seq = entry.item.seq
            if token < 0 or seq.finish_reason is not None:  # failed, or a stop string ended it
                continue
            appended = (seq, token, append_id(seq, token, None, None, now))
            (deferred if _waits(seq) else at_once).append(appended)
        return self.make_outputs(at_once)

    def sample_later(self, targets, results, bad: set[str]) -> list[RequestOutput]:
        """``LLMEngine._sample``'s tokens join their sequences (forking them, advancing
        their grammars); the outputs of those that go on past their first token wait, as
        do all of a request of n > 1 (its output covers its n sequences)."""
        now, appended, at_once = time.time(), [], []
        append_id, deferred = self.outputs.append_id, self._deferred
        for (seq, i), result in zip(targets, results):
            if bad and seq.request.request_id in bad:
                continue
            target = self._fork(seq, i) if i else seq
            token = result.token_id
            can_stop = append_id(target, token, result.logprob, result.top_logprobs, now)
            if target.guide is not None:
                advance_guide(target, token)
            if not _waits(target):
                at_once.append((target, token, can_stop))
                continue
            deferred.append((target, token, can_stop))
            if target.finish_reason is not None:  # a sample of n > 1 that ended
                appended.append(target)
        for seq in appended:  # the next step is not scheduled with them
            if not seq.is_finished:
                self.scheduler.finish(seq)
        return self.make_outputs(at_once)

    def run_deferred(self, running: SchedulerOutput | None = None) -> list[RequestOutput]:
        """The outputs of the tokens deferred so far. ``running``: the step now on the
        device; a sequence a stop string ends gets back the charge of its chunk there
        (its token there is dropped)."""
        entries, self._deferred = self._deferred, []
        return self.make_outputs(entries, running) if entries else []

    def make_outputs(self, entries, running: SchedulerOutput | None = None) -> list:
        """Detokenize ``entries`` (sequence, token, can_stop) in order, check their stop
        strings and make their requests' outputs (``_collect`` ends the finished ones)."""
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


def _waits(seq: Sequence) -> bool:
    """Whether the output of the token ``seq`` just took waits for the next step: a
    token between its first and its end, or any of a request of n > 1 (one output covers
    its n sequences). First tokens and ends are made at once (time to first token)."""
    if seq.request.params.n > 1:
        return True
    return seq.finish_reason is None and seq.num_output_tokens > 1
