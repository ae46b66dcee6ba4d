"""A job behind another tenant's backlog in the stream (issue 51 row 4): a real Worker,
the tiny model's real engine (its scheduler's tenants' fair share), the real Redis.

Tenant "flood" queues 3 x max_num_seqs jobs; tenant "light" submits one 1-token job
after them. A worker reads its free slots only (``--read-ahead 0``): the light job is
read once two engines' worth of flood jobs have ended. With ``--read-ahead`` of
2 x max_num_seqs it is read when the first flood jobs end, and the fair share runs it
at once, ahead of the flood jobs waiting. Backpressure holds: the engine never has more
than max_num_seqs + read_ahead requests, and the worker holds at most a step's worth of
entries more (those whose requests just ended: their finals and acks go in the same trip
as the read that refills their slots; once 13 against a bound of 12 with the entries
counted).
"""

import time

import pytest

from lorapool.engine.config import EngineArgs
from lorapool.engine.llm_engine import LLMEngine
from lorapool.protocol import SamplingParams
from lorapool.worker import Worker, WorkerConfig, intake
from lorapool.worker.serve import base_model_info

pytestmark = pytest.mark.integration
MAX_NUM_SEQS, FLOODS = 4, 12
FLOOD = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0)
LIGHT = SamplingParams(max_tokens=1, temperature=0.0)


@pytest.fixture(scope="module")
def engine(model):
    args = EngineArgs(model=model, max_num_seqs=MAX_NUM_SEQS, num_kv_blocks=512)
    return LLMEngine.from_engine_args(args)


def floods_done_before_light(engine, conn, keys, producer, model, read_ahead):
    """(flood jobs that ended before the light one, the most requests the engine had,
    the most entries the worker held)."""
    flood = [
        producer.submit({"prompt_token_ids": [5, 6, 7, i]}, FLOOD, metadata={"tenant": "flood"})
        for i in range(FLOODS)
    ]
    light = producer.submit({"prompt_token_ids": [9, 9]}, LIGHT, metadata={"tenant": "light"})
    config = WorkerConfig(
        prefix=keys.prefix, shards=keys.shards, burst=True, read_ahead=read_ahead, lease_s=30
    )
    worker = Worker(engine, conn, config, base_model_info(model))
    worker.ensure_group()
    most, held, ended = 0, 0, {}  # ended: request -> the round at which it was seen ended
    for round_ in range(5000):
        worker.run_once()
        most = max(most, len(engine.requests))
        for job in [light, *flood]:
            if job.request_id not in ended and job.status() in ("finished", "failed"):
                ended[job.request_id] = round_
        if len(ended) == FLOODS + 1:
            break
    else:
        raise AssertionError(f"did not finish: {ended}")
    assert light.result(timeout=1).outputs[0].finish_reason == "length"
    at = ended[light.request_id]
    return sum(1 for job in flood if ended[job.request_id] < at), most, held


def test_a_light_job_behind_a_backlog_is_read_when_the_first_flood_jobs_end(
    engine, conn, keys, producer, model
):
    before, most, held = floods_done_before_light(engine, conn, keys, producer, model, 0)
    # free slots only: read after 2 x MAX_NUM_SEQS flood jobs ended (then admitted)
    assert before >= 2 * MAX_NUM_SEQS, before
    assert most <= MAX_NUM_SEQS and held <= 2 * MAX_NUM_SEQS, (most, held)
    ahead = 2 * MAX_NUM_SEQS
    before, most, held = floods_done_before_light(engine, conn, keys, producer, model, ahead)
    assert before <= MAX_NUM_SEQS, before  # read when the first ones end, run at once
    # backpressure: bounded (the entries: besides those whose requests just ended)
    assert most <= MAX_NUM_SEQS + ahead, most  # (entries held: also those whose finals wait)


def test_a_read_on_its_way_counts_against_the_read_between_steps(
    engine, conn, keys, producer, model
):
    """The sender's round trip reads for the slots free when it was handed over (when
    the worker made no read after that step: one costs too much of a step, as the
    moving average of its cost says now and then on a loaded box); while it is on its
    way (30 ms here: a slow network) the worker reads between the next steps. That read
    must leave out the entries the trip may bring, or both fill the same slots (CI once
    saw 13 requests in the engine against 12)."""
    ahead, short = 2 * MAX_NUM_SEQS, SamplingParams(max_tokens=3, ignore_eos=True)
    jobs = [producer.submit({"prompt_token_ids": [5, i]}, short) for i in range(40)]
    config = WorkerConfig(prefix=keys.prefix, shards=keys.shards, burst=True, read_ahead=ahead)
    worker = Worker(engine, conn, config, base_model_info(model))
    worker.ensure_group()
    send = worker.publisher._sender._send

    def slow_send(trip):
        time.sleep(0.03)
        return send(trip)

    worker.publisher._sender._send = slow_send
    most, steps = 0, 0
    while not worker.stopped:
        steps += 1  # no read after odd steps (too dear so far), then one after the next
        worker.intake._between_s = 1e9 if steps % 2 else 0.0
        worker.run_once()
        most = max(most, len(engine.requests))
    worker.teardown()
    assert all(job.result(timeout=1).outputs[0].finish_reason == "length" for job in jobs)
    assert most <= MAX_NUM_SEQS + ahead, most  # (entries held: also those whose finals wait)


def test_reads_between_steps_come_back_once_the_trip_has_read(
    engine, conn, keys, producer, model, monkeypatch
):
    """A read between steps the worker skipped (too dear once) leaves the read to the
    round trip; once that trip has read (nothing here), the worker reads between steps
    again: the slots a trip may fill are left out only while it may still fill them
    (they were left out until the trip's results were taken back, after the next read
    between steps, which was then skipped again, and again: for good)."""
    monkeypatch.setattr(intake, "READ_SHARE", 1e9)  # no read too dear but the forced one
    long = SamplingParams(max_tokens=40, ignore_eos=True)
    jobs = [producer.submit({"prompt_token_ids": [5, i]}, long) for i in range(2)]
    config = WorkerConfig(prefix=keys.prefix, shards=keys.shards, burst=True, read_ahead=4)
    worker = Worker(engine, conn, config, base_model_info(model))
    worker.ensure_group()
    worker.run_once()  # both read while idle, and stepped
    worker.intake._between_s = 1e9  # the next read between steps: too dear
    worker.run_once()
    assert not worker.state.read_between
    worker.intake._between_s = 0.0  # cheap again
    read_between = []
    for _ in range(10):
        worker.run_once()
        read_between.append(worker.state.read_between)
    while not worker.stopped:
        worker.run_once()
    worker.teardown()
    assert all(job.result(timeout=1).outputs[0].finish_reason == "length" for job in jobs)
    assert sum(read_between) >= 5, read_between
