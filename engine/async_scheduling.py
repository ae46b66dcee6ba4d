"""Async scheduling: the next step scheduled, packed and queued on the device before
this step's tokens are read back.

vLLM V1's ``async_scheduling``, in one process. With ``EngineArgs.async_scheduling``, a
step whose every row samples on the device alone is left in flight: every row but a
grammar's (its mask needs the token before) and a request of n > 1's first (it forks
its samples): greedy or drawn at a temperature with top-k, top-p (each row sorted
whole: ``warpers.top_p``'s ``sync_free``) or min-p, with logprobs (copied back with
the tokens: ``logprobs.StepLogprobs``), logit_bias, penalties (the token in flight
counted from the device: ``penalties.apply_penalties``'s ``pending``) and min_tokens or
not (``Request.device_only``, ``sampler.argmax_rows``). Its tokens are queued
on the device after the forward and their copy to the host started
(``host_copy.ReadBack``), and ``step()`` returns without waiting for them. The next
``step()`` call then:

1. gives each sequence the step in flight samples for a placeholder token
   (``PLACEHOLDER``), so the scheduler runs it one more token, as if its token were known
   (``hold_places``): it is scheduled and charged to its tenant as usual;
2. packs that step; the placeholders among its input ids take the step in flight's
   tokens on the device (``fill_places``: one gather, no host round trip), and queues its
   forward;
3. only then reads the step in flight's tokens back (waiting for that step alone),
   replaces the placeholders, runs the stop checks, finishes what ended and makes the
   outputs (``land``), while the device runs the step it just queued.

So the host's whole step (schedule, packing, outputs, the next schedule) overlaps the
device's forward: the device waits for the host only when the host's work is longer.
What a sequence ended by the step in flight (EOS, stop ids or strings, max_tokens)
costs: its row in the next step, computed and dropped (its token never joins it), and
that chunk's charge given back to its tenant (``Scheduler.refund``) before the schedule
after it; a request's output comes from the ``step()`` call after the one that ran it.
Tokens, texts, logprobs and finish reasons are the synchronous engine's.

A step with another row (a grammar's, a fork, prompt logprobs) lands the step in
flight before it samples and is not left in flight itself: those rows read the tokens
before them or read back while sampling.
A seeded row draws what it draws in the synchronous engine; an unseeded row's number
comes from the sampler's generator, which the row of a sequence that the step in flight
ends also advances (the distribution is the same, the draws move).
``abort_request`` and ``fail_request`` land the step in flight first. Off by default,
and exclusive with ``async_output_proc`` (whose work it does for the steps in flight): on the
CPU, where torch runs each op before returning, nothing overlaps and every output comes
a forward later; the GPU kit measures it (``bench gpu``'s
``flag_async_scheduling_*``). How it fits the fair share: ``engine.scheduler_output``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from lorapool.engine.host_copy import ReadBack, to_device
from lorapool.engine.logprobs import StepLogprobs
from lorapool.engine.penalties import needs_token_lists
from lorapool.engine.sampler import SamplingRow, argmax_rows, finite_argmax
from lorapool.engine.scheduler_output import SchedulerOutput
from lorapool.engine.sequence import PLACEHOLDER, Sequence, SequenceStatus
from lorapool.outputs import RequestOutput

read_back = ReadBack  # benchmarks' stand-in device replaces it (_paced_forward.py)


@dataclass(slots=True)
class InFlight:
    """A step queued on the device whose tokens are not read yet."""

    entries: list  # its sampling LogitsRows (``sample_row``: their row in ``tokens``)
    tokens: torch.Tensor  # [rows] int64 on the device: each row's token, -1 not finite
    host: ReadBack  # their copy to the host
    held: list[Sequence]  # the sequences given a placeholder for it (``hold_places``)
    logprobs: StepLogprobs | None = None  # of the rows that asked, copied back too


class PipelinedSteps:
    """LLMEngine's half of async scheduling: the step in flight."""

    _in_flight: InFlight | None

    def hold_places(self) -> None:
        """Each sequence the step in flight samples for takes a placeholder token, which
        the next schedule runs as its next token."""
        flight = self._in_flight
        if flight is None or flight.held:  # held: a step() that raised before it landed
            return
        limit = self.max_model_len
        for entry in flight.entries:
            seq = entry.item.seq
            if seq.finish_reason is not None or seq.is_finished:
                continue
            if seq.num_tokens + 1 >= limit or seq.num_output_tokens + 1 >= seq.request.max_tokens:
                self._retire(seq)  # its token in flight is its last, whatever it is
                continue
            seq.token_ids.append(PLACEHOLDER)
            flight.held.append(seq)

    def _retire(self, seq: Sequence) -> None:
        """``seq`` ends with its token in flight (max_tokens, the model length): it leaves
        the scheduler now, so the next step has no row for it and its blocks are free
        for others (the step in flight, queued before, writes them first); it finishes
        when that token lands (``_collect``; an abort or error before gives its reason)."""
        self.scheduler.finish(seq)
        seq.status = SequenceStatus.RUNNING  # for the engine, until the token lands

    def fill_places(self, batch, scheduled: SchedulerOutput) -> None:
        """The placeholders among ``batch``'s input ids (packed from ``scheduled``) take
        the step in flight's tokens: a gather on the device, queued after that step."""
        flight = self._in_flight
        if flight is None or not flight.held:  # landed meanwhile (an abort, a failure)
            return
        source = {entry.item.seq.seq_id: entry.sample_row for entry in flight.entries}
        rows, sources, at = [], [], 0
        for item in scheduled.scheduled:
            seq, start = item.seq, item.start
            i = source.get(seq.seq_id)
            last = seq.num_tokens - 1  # a placeholder is a sequence's last token
            if (
                i is not None
                and start <= last < start + item.num_new_tokens
                and (seq.token_ids[last] == PLACEHOLDER)
            ):
                rows.append(at + last - start)
                sources.append(i)
            at += item.num_new_tokens
        if not rows:
            return
        index = to_device(rows + sources, flight.tokens.device, torch.long)
        tokens = flight.tokens.index_select(0, index[len(rows) :]).clamp_(min=0)
        batch.input_ids.index_copy_(0, index[: len(rows)], tokens)  # -1: a failed row

    def pipelined(self, scheduled, layout, logits, sampled, masks) -> list[RequestOutput]:
        """After ``scheduled``'s forward was queued: a step whose rows all sample on the
        device alone is left in flight (its tokens read back by the next call), the
        step before it landed meanwhile; any other step lands the one in flight first,
        then samples as usual."""
        drawn = None if sampled is not None else argmax_rows(layout, drawn=True)
        if (sampled or drawn) is not None and len(sampled or drawn) == logits.shape[0]:
            logprobs = None
            if sampled is None:  # temperature, top-k, top-p, min-p, logprobs: on the device
                sampled, (tokens, logprobs) = drawn, self._draw(logits, drawn)
            else:
                tokens = finite_argmax(logits)
            host = read_back(tokens)
            outputs = self.land(scheduled)  # while the device runs ``scheduled``
            if any(entry.item.seq.finish_reason is None for entry in sampled):
                self._in_flight = InFlight(sampled, tokens, host, [], logprobs)
            return outputs
        outputs = self.land(scheduled)
        if sampled is not None:  # greedy, with prompt logprobs' rows
            live = [entry for entry in sampled if entry.item.seq.finish_reason is None]
            tokens = finite_argmax(logits).tolist()
            return outputs + self._take_argmax(logits, tokens, layout, live)
        return outputs + self._process_logits(logits, layout, masks)

    def _draw(self, logits: torch.Tensor, entries: list) -> tuple:
        """The tokens of ``entries`` (``Request.device_only``, a row each, in order),
        drawn on the device, and the logprobs of those that asked. A seeded row's number
        comes from its tokens so far, its placeholder included: as in the synchronous
        engine, where the token in flight has joined it; an unseeded row's from the
        sampler's generator, which a row of a sequence that the step in flight ends also
        advances."""
        of_tokens = SamplingRow.of_tokens
        seqs = [entry.item.seq for entry in entries]
        rows = [
            of_tokens(seq.request.params, seq.token_ids, seq.num_prompt_tokens, seq.index)
            for seq in seqs
        ]
        return self.sampler.on_device(logits, rows, self._pending_tokens(seqs, rows))

    def _pending_tokens(self, seqs: list[Sequence], rows: list) -> torch.Tensor | None:
        """[S] on the device: the token in flight of each of ``seqs`` that holds a
        placeholder (their penalties count it), for a step with penalties; else None."""
        flight = self._in_flight
        if flight is None or not flight.held or not any(map(needs_token_lists, rows)):
            return None
        source = {entry.item.seq.seq_id: entry.sample_row for entry in flight.entries}
        held = [
            source.get(seq.seq_id, 0) if seq.token_ids[-1] == PLACEHOLDER else 0 for seq in seqs
        ]
        return flight.tokens.index_select(0, to_device(held, flight.tokens.device, torch.long))

    def land(self, running: SchedulerOutput | None) -> list[RequestOutput]:
        """The step in flight's tokens join their sequences (in place of their
        placeholders) and make their outputs; then ``running``, the step queued since,
        counts as computed, its chunks of sequences that ended given back."""
        flight, self._in_flight = self._in_flight, None
        outputs = []
        if flight is not None:
            for seq in flight.held:
                seq.token_ids.pop()  # its placeholder
            tokens = flight.host.tolist()
            outputs = self._land_tokens(flight.entries, tokens, flight.logprobs)
        if running is not None:
            ended = [item for item in running.scheduled if item.seq.finish_reason is not None]
            for item in ended:
                self.scheduler.refund(item)
            if ended:
                kept = [item for item in running.scheduled if item.seq.finish_reason is None]
                running = SchedulerOutput(scheduled=kept)
            self.scheduler.postprocess(running)
        return outputs

    def _land_tokens(
        self, entries: list, tokens: list[int], logprobs: StepLogprobs | None = None
    ) -> list[RequestOutput]:
        """``tokens`` (by ``sample_row``, -1 not finite) join the sequences of
        ``entries`` that go on, with their ``logprobs`` where asked; each request's
        output as ``LLMEngine._sample`` makes it (one for the n sequences of a request of
        n > 1)."""
        if -1 in tokens:
            rows = [e for e in entries if e.item.seq.finish_reason is None]
            self._fail_non_finite(
                {e.item.seq.request.request_id for e in rows if tokens[e.sample_row] < 0}
            )
        asked = logprobs.results(tokens) if logprobs is not None else {}
        appended, append, now = [], self.outputs.append, time.time()
        for entry in entries:
            seq = entry.item.seq
            if seq.finish_reason is None:  # else ended in flight, or failed just now
                row = entry.sample_row
                append(seq, tokens[row], *asked.get(row, (None, None)), now)
                appended.append(seq)
        return self._outputs_after(appended)

    def flush_in_flight(self) -> None:
        """Land the step in flight now (its outputs into the next ``step()``'s): before a
        request ends by abort or error, so that its last output holds all its tokens."""
        if self._in_flight is not None:
            self._pending += self.land(None)
