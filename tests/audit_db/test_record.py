"""Parsing, validating and building audit records (no server)."""

import copy

import orjson
import pytest

from lorapool import CompletionOutput, RequestMetrics, RequestOutput
from lorapool.records.adapter import ModelIdentity
from lorapool.records.audit import (
    RecordError,
    encode_audit_record,
    parse_record,
    record_from_dict,
    record_from_output,
)

pytest_plugins = ["audit_fixtures"]


def _valid():
    from audit_fixtures import make_adapter, make_record

    return make_record(7, adapter=make_adapter(), n=2)


def test_valid_record_round_trips():
    data = _valid()
    record = parse_record(orjson.dumps(data))
    assert record.request_id == "req-7"
    assert record.adapter.name == "sql-lora" and record.adapter.target_modules == (
        "q_proj",
        "v_proj",
    )
    assert [o.index for o in record.outputs] == [0, 1]
    assert orjson.loads(encode_audit_record(record)) == data


def test_base_model_record_has_no_adapter():
    data = _valid()
    data["adapter"] = None
    assert record_from_dict(data).adapter is None


def _set(path, value):
    def mutate(data):
        *parents, last = path
        for key in parents:
            data = data[key]
        data[last] = value

    return mutate


def _drop(path):
    def mutate(data):
        *parents, last = path
        for key in parents:
            data = data[key]
        del data[last]

    return mutate


MALFORMED = [
    (_set(["v"], 2), "unknown record version"),
    (_drop(["request_id"]), "record: Object missing required field `request_id`"),
    (_set(["request_id"], ""), "request_id: Expected `str` of length >= 1"),
    (_set(["request_id"], 5), "request_id: Expected `str`, got `int`"),
    (_set(["prompt_token_ids"], [1, "x"]), "prompt_token_ids"),
    (_drop(["worker"]), "missing required field `worker`"),
    (_set(["base_model"], "smol"), "base_model: Expected `object`, got `str`"),
    (_drop(["adapter", "sha256"]), "adapter: Object missing required field `sha256`"),
    (_set(["adapter", "id"], True), "adapter.id: Expected `int`, got `bool`"),
    (_set(["adapter", "alpha"], "16"), "adapter.alpha: Expected `float`, got `str`"),
    (_set(["metrics", "arrival_time"], None), "metrics.arrival_time"),
    (_drop(["metrics", "num_prompt_tokens"]), "num_prompt_tokens"),
    (_set(["outputs"], {}), "outputs: Expected `array`, got `object`"),
    (
        _set(["outputs", 0, "finish_reason"], "eos"),
        "finish_reason: Invalid enum value 'eos', not one of",
    ),
    (_set(["outputs", 0, "finish_reason"], None), "finish_reason"),
    (_set(["outputs", 1, "index"], 0), "duplicate completion index"),
    (_set(["outputs", 0, "stop_reason"], [1]), "stop_reason"),
    (_set(["outputs", 0, "text"], None), "outputs[0].text: Expected `str`, got `null`"),
    (_set(["outputs", 0, "token_ids"], [1, True]), "outputs[0].token_ids[1]: Expected `int`"),
    (_set(["sampling_params"], [1]), "sampling_params"),
]


@pytest.mark.parametrize("mutate, reason", MALFORMED)
def test_malformed_records_say_why(mutate, reason):
    data = copy.deepcopy(_valid())
    mutate(data)
    with pytest.raises(RecordError, match=reason.replace("[", r"\[").replace("]", r"\]")):
        record_from_dict(data)


@pytest.mark.parametrize("payload", [b"", b"{", b"[]", b"null", b"\xff"])
def test_garbage_payloads_are_record_errors(payload):
    with pytest.raises(RecordError):
        parse_record(payload)


def _finished_output(error=None, outputs=None):
    metrics = RequestMetrics(
        arrival_time=100.0,
        first_scheduled_time=100.1,
        first_token_time=100.2,
        last_token_time=100.9,
        finished_time=101.0,
        time_in_queue=0.1,
        num_prompt_tokens=3,
        num_generated_tokens=4,
    )
    if outputs is None:
        outputs = [CompletionOutput(0, "hi there", [5, 6, 7, 8], -2.5, None, "stop", 8)]
    return RequestOutput(
        "req-x", "say hi", [1, 2, 3], None, outputs, True, metrics=metrics, error=error
    )


def test_record_from_output_builds_a_valid_record():
    from audit_fixtures import BASE_MODEL, make_adapter

    record = record_from_output(
        _finished_output(),
        worker="gpu-0",
        base_model=ModelIdentity(**BASE_MODEL),
        adapter=make_adapter(),
        sampling_params={"max_tokens": 8},
        metadata={"tenant": "acme"},
    )
    assert parse_record(encode_audit_record(record)) == record
    assert record.metrics.queue_time == 0.1 and record.metrics.finished_time == 101.0
    assert record.outputs[0].stop_reason == 8 and record.outputs[0].token_ids == (5, 6, 7, 8)
    assert record.adapter.sha256 == make_adapter()["sha256"]
    assert record.metadata == {"tenant": "acme"} and record.worker == "gpu-0"


def test_record_from_output_of_a_failed_request():
    from audit_fixtures import BASE_MODEL

    unfinished = CompletionOutput(0, "par", [5], None, None, None, None)
    output = _finished_output(error="CUDA out of memory", outputs=[unfinished])
    record = record_from_output(
        output, worker="gpu-0", base_model=ModelIdentity(**BASE_MODEL), adapter=None
    )
    assert parse_record(encode_audit_record(record)) == record
    assert record.error == "CUDA out of memory"
    assert record.outputs[0].finish_reason == "error"


def _outcome(parse, data):
    try:
        return repr(parse(data))  # repr: 16 and 16.0 differ, as the chain's JSON does
    except RecordError as exc:
        return f"RecordError: {exc}"


@pytest.mark.parametrize("payload", [b"", b"{", b"[]", b"null", b"\xff", b'{"v": 1}'])
def test_garbage_is_a_record_error(payload):
    # (the audit writer parses with ``parse_record`` itself since issue 50: its own
    # decoder, checked against it here before, is gone)
    assert _outcome(parse_record, payload).startswith("RecordError")


def test_null_where_the_wire_has_an_empty_default_reads_as_left_out():
    data = _valid()
    data.update(prompt_token_ids=None, sampling_params=None, metadata=None)
    record = record_from_dict(data)
    assert (record.prompt_token_ids, record.sampling_params, record.metadata) == ((), {}, {})
    assert data["metadata"] is None  # the caller's dict is left as it was
