"""The batch's RQ jobs (JSON-serialized; each runs once the one before has finished):

    validate_batch -> enqueue_lines -> collect

Each takes the batch id and a JSON-able config, and finds Redis through RQ's current
job, so any RQ worker of the queue runs them. None loads a model: the lines run as
ordinary pool jobs with request ids ``<batch>:<custom_id>``; submitting one again
(a retried job) finds its id taken and enqueues nothing.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass
from itertools import islice
from typing import Any

import redis
from rq import Queue, Retry, get_current_job
from rq.serializers import JSONSerializer

from lorapool.batch.collector import Collector
from lorapool.batch.files import DEFAULT_RETENTION_S, FileStore
from lorapool.batch.lines import check_file, check_line_grammar, read_lines
from lorapool.batch.pacing import Pacer
from lorapool.batch.state import BatchState, Status
from lorapool.grammar_sandbox import GrammarSandbox
from lorapool.lifecycle.keys import DEFAULT_PREFIX, Keys
from lorapool.producer import Producer
from lorapool.protocol import LoRARequest
from lorapool.records.adapter import decode_model_identity

logger = logging.getLogger(__name__)
SUBMIT_LINES = 256  # lines a submit_many sends in one round trip
RESULT_TTL_S = 7 * 24 * 3600  # a line's output stays readable until collected


@dataclass
class BatchConfig:
    """Where a pool's batches live (its Redis: state and files); travels with each RQ
    job as JSON."""

    prefix: str = DEFAULT_PREFIX
    shards: int = 0  # the pool's shard count (``lorapool.lifecycle.keys``)
    queue: str = "lorapool-batch"
    retention_s: int = DEFAULT_RETENTION_S
    result_ttl_s: int = RESULT_TTL_S
    poll_s: float = 1.0  # how often a waiting collector looks at the batch's status
    max_stop: int = 4  # stop strings a line may name: the gateway's --max-stop (OpenAI's 4)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def keys(self) -> Keys:
        return Keys(self.prefix, self.shards)

    def files(self, connection: redis.Redis) -> FileStore:
        """The pool's batch files, in ``connection`` (its Redis)."""
        return FileStore(connection, self.keys, self.retention_s)


def rq_queue(connection: redis.Redis, config: BatchConfig) -> Queue:
    return Queue(config.queue, connection=connection, serializer=JSONSerializer)


def enqueue_step(connection: redis.Redis, config: BatchConfig, step: str, batch_id: str) -> None:
    """Enqueue one step of a batch; its RQ job id is derived from the batch id."""
    rq_queue(connection, config).enqueue(
        f"lorapool.batch.tasks.{step}",
        batch_id,
        config.to_dict(),
        job_id=f"{batch_id}-{step.replace('_', '-')}",
        retry=Retry(max=3, interval=[1, 5, 15]),
        job_timeout=-1 if step == "collect" else 3600,
        result_ttl=24 * 3600,
    )


def _context(raw: dict[str, Any]) -> tuple[redis.Redis, BatchConfig, BatchState]:
    connection = get_current_job().connection
    config = BatchConfig(**raw)
    return connection, config, BatchState(connection, config.keys)


def base_model(connection: redis.Redis, keys: Keys) -> str | None:
    """The pool's base model name (None before any worker started)."""
    base = decode_model_identity(connection.get(keys.model))
    return None if base is None else base.name


def known_models(connection: redis.Redis, keys: Keys) -> set[str]:
    """The names a line's model may be: the adapters in the registry and the base model."""
    names = {k.decode() for k in connection.hkeys(keys.adapters)}
    return names | {base_model(connection, keys)} - {None}


def validate_batch(batch_id: str, raw: dict[str, Any]) -> str:
    """Check every line; a bad file fails the batch with each line's reason."""
    connection, config, state = _context(raw)
    batch = state.get(batch_id)
    if _settle_cancel(state, batch_id):
        return "cancelled"
    files, models = config.files(connection), known_models(connection, config.keys)
    producer = Producer(connection, config.prefix, shards=config.shards)
    lines = files.lines(batch["input_file_id"])
    pacer = Pacer(connection, config.keys, state.owner(batch_id))
    grammars = GrammarSandbox()  # a line whose grammar crashes its compiler fails alone
    try:
        report = check_file(
            lines,
            batch_id,
            models.__contains__,
            producer.limits,
            _line_checks(pacer, grammars),
            batch["endpoint"],
            config.max_stop,
        )
    finally:
        grammars.close()
    if report.num_errors:
        errors = [{"code": "invalid_request", **e} for e in report.errors]
        state.set(batch_id, errors=errors, total=report.total)
        state.move(batch_id, Status.FAILED, Status.VALIDATING, Status.CANCELLING)
        return "failed"
    state.set(batch_id, total=report.total)
    if not state.move(batch_id, Status.IN_PROGRESS, Status.VALIDATING):
        _settle_cancel(state, batch_id)
        return "cancelled"
    enqueue_step(connection, config, "enqueue_lines", batch_id)
    return "in_progress"


def _line_checks(pacer: Pacer, grammars: GrammarSandbox):
    def check(line) -> None:
        pacer.check(line)
        check_line_grammar(line, grammars)

    return check


def _settle_cancel(state: BatchState, batch_id: str) -> bool:
    return state.move(batch_id, Status.CANCELLED, Status.CANCELLING)


def enqueue_lines(batch_id: str, raw: dict[str, Any]) -> int:
    """Submit the lines as pool jobs, a few hundred a round trip, until done or cancelled;
    then start the collector. Returns the number of lines submitted."""
    connection, config, state = _context(raw)
    batch, owner = state.get(batch_id), state.owner(batch_id)
    producer = Producer(
        connection, config.prefix, result_ttl_s=config.result_ttl_s, shards=config.shards
    )
    lines, loras, sent = (
        read_lines(
            config.files(connection).lines(batch["input_file_id"]), batch_id, producer.limits
        ),
        {},
        0,
    )
    pacer = Pacer(connection, config.keys, owner)

    def stopped() -> bool:
        return state.status(batch_id) != Status.IN_PROGRESS

    while chunk := _paced(lines, pacer, stopped):
        if stopped():
            break
        producer.submit_many(
            [line.parsed.prompts[0] for line in chunk],
            [line.parsed.params for line in chunk],
            [_lora(producer, loras, line.parsed.model) for line in chunk],
            [line.request_id(batch_id) for line in chunk],
            {"batch_id": batch_id, **owner},  # the tenant and key id reach the audit rows
            priority="batch",  # read by workers only with capacity left over
        )
        sent += len(chunk)
    logger.info("batch %s: %d lines submitted", batch_id, sent)
    enqueue_step(connection, config, "collect", batch_id)
    return sent


def _paced(lines, pacer: Pacer, stopped) -> list:
    """The next lines to submit in one round trip: ``SUBMIT_LINES`` of them, or under
    the owner's rate limits one line, as soon as the limits let it through."""
    if pacer.limiter is None:
        return list(islice(lines, SUBMIT_LINES))
    line = next(lines, None)
    return [line] if line is not None and pacer.admit(line, stopped) else []


def _lora(producer: Producer, cache: dict, model: str) -> LoRARequest | None:
    if model not in cache:
        is_base = model == base_model(producer.redis, producer.keys)
        cache[model] = None if is_base else producer.registry.resolve(model)
    return cache[model]


def collect(batch_id: str, raw: dict[str, Any]) -> str:
    """Wait for every line's final output and write the output and error files."""
    connection, config, state = _context(raw)
    producer = Producer(connection, config.prefix, shards=config.shards)
    collector = Collector(producer, state, config.files(connection), batch_id, config.poll_s)
    final = collector.run()
    logger.info("batch %s: %s at %s", batch_id, final.value, time.strftime("%H:%M:%S"))
    return final.value
