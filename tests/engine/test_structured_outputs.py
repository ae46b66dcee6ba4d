"""Structured outputs in the engine: every constrained completion validates against its
constraint (jsonschema, ``re.fullmatch``, the choices, a Lark parse) on the tiny
random model, in one mixed batch with unconstrained requests, which keep the
tokens they have alone; logit_bias against transformers' argmax."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lorapool import EngineArgs, LLMEngine, SamplingParams
from lorapool.records.structured import StructuredOutputsParams as S

PET = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "vaccinated": {"type": "boolean"},
    },
    "required": ["name", "age", "kind", "tags", "vaccinated"],
    "additionalProperties": False,
}
REGEX = r"[0-9]{3}-[a-z]{2,5}"
CHOICES = ["positive", "negative", "neutral"]
LARK = 'start: "call(" NUM ("," NUM)* ")"\nNUM: /[0-9]{1,3}/\n'
GBNF = 'root ::= "ok " [a-c]{2,4}'


@pytest.fixture(scope="module")
def engine(tiny_model_path):
    path = tiny_model_path("llama")
    return LLMEngine.from_engine_args(EngineArgs(model=str(path), max_num_seqs=32))


def run(engine, requests: dict[str, tuple[str | list[int], SamplingParams]]):
    for rid, (prompt, params) in requests.items():
        if isinstance(prompt, list):
            prompt = {"prompt_token_ids": prompt}
        engine.add_request(rid, prompt, params)
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    return finals


def valid(constraint: S, text: str) -> bool:
    kind = constraint.kind
    if kind in ("json", "json_object"):
        value = json.loads(text)
        jsonschema.validate(value, constraint.json or {"type": "object"})
        return True
    if kind == "regex":
        return re.fullmatch(constraint.regex, text) is not None
    if kind == "choice":
        return text in constraint.choice
    if constraint.grammar == LARK:
        return re.fullmatch(r"call\([0-9]{1,3}(,[0-9]{1,3})*\)", text) is not None
    return re.fullmatch(r"ok [a-c]{2,4}", text) is not None


CONSTRAINTS = {
    "json": S(json=PET),
    "json-text": S(json=json.dumps(PET)),
    "object": S(json_object=True),
    "regex": S(regex=REGEX),
    "choice": S(choice=CHOICES),
    "lark": S(grammar=LARK),
    "gbnf": S(grammar=GBNF),
}


def test_a_mixed_batch_validates_and_leaves_the_others_exact(engine):
    plain = {
        f"plain-{i}": ([5 + i, 40, 77, 120 + i], SamplingParams(temperature=0.0, max_tokens=20))
        for i in range(4)
    }
    alone = run(engine, plain)
    requests = dict(plain)
    for name, constraint in CONSTRAINTS.items():
        budget = 400 if name == "object" else 120
        requests[f"{name}-greedy"] = (
            "The quick brown fox",
            SamplingParams(temperature=0.0, max_tokens=budget, structured_outputs=constraint),
        )
        requests[f"{name}-sampled"] = (
            [9, 8, 7],
            SamplingParams(
                temperature=1.0, seed=7, n=3, max_tokens=budget, structured_outputs=constraint
            ),
        )
    mixed = run(engine, requests)
    for rid in plain:
        assert mixed[rid].outputs[0].token_ids == alone[rid].outputs[0].token_ids
    for rid, (_, params) in requests.items():
        if rid in plain:
            continue
        assert mixed[rid].error is None, mixed[rid].error
        assert len(mixed[rid].outputs) == params.n
        for completion in mixed[rid].outputs:
            assert completion.finish_reason == "stop", (rid, completion.text)
            assert valid(params.structured_outputs, completion.text), (rid, completion.text)


def test_greedy_json_has_every_required_key(engine):
    params = SamplingParams(temperature=0.0, max_tokens=200, structured_outputs=S(json=PET))
    [out] = run(engine, {"j": ("Hello", params)}).values()
    assert set(json.loads(out.outputs[0].text)) == set(PET["required"])


@pytest.mark.parametrize(
    "constraint, problem",
    [
        (S(json={"type": "objectx"}), "objectx"),
        (S(regex="(("), "unclosed group"),
        (S(grammar="start: missing_rule"), "missing_rule"),
        (S(json={"$ref": "#/$defs/nowhere"}), "does not exist"),
    ],
)
def test_an_invalid_constraint_is_refused_at_add_request(engine, constraint, problem):
    with pytest.raises(ValueError, match=problem) as info:
        engine.add_request("bad", "Hi", SamplingParams(structured_outputs=constraint))
    assert "request bad" in str(info.value)
    assert "bad" not in engine.requests
    # the path a worker's refusal carries: readers name the parameter by it (issue 50)
    assert info.value.field == "sampling_params.structured_outputs"


def test_a_grammar_that_ends_under_min_tokens_still_ends(engine):
    """min_tokens bans EOS, which a complete grammar needs: the grammar wins."""
    params = SamplingParams(
        temperature=0.0, max_tokens=30, min_tokens=25, structured_outputs=S(choice=["yes", "no"])
    )
    [out] = run(engine, {"m": ("Q", params)}).values()
    assert out.outputs[0].text in ("yes", "no")
    assert out.outputs[0].finish_reason == "stop"


def test_a_resumed_request_continues_its_grammar(engine):
    """Failover: a request resumed after some tokens ends with a valid whole."""
    params = SamplingParams(temperature=0.0, max_tokens=120, structured_outputs=S(json=PET))
    [whole] = run(engine, {"w": ("Resume me", params)}).values()
    head = whole.outputs[0].token_ids[:5]
    engine.add_request("r", "Resume me", params, resume_token_ids=head)
    finals = run(engine, {})
    resumed = finals["r"].outputs[0]
    assert resumed.token_ids == whole.outputs[0].token_ids
    with pytest.raises(ValueError, match="do not follow") as info:
        engine.add_request("r2", "Resume me", params, resume_token_ids=[5, 6, 7])
    assert info.value.field == "sampling_params.structured_outputs"


def test_preempted_constrained_requests_stay_valid(tiny_model_path):
    """A KV cache too small for the batch: sequences are preempted and recomputed."""
    path = tiny_model_path("llama")
    small = LLMEngine.from_engine_args(EngineArgs(model=str(path), num_kv_blocks=12))
    requests = {
        f"p{i}": (
            [3 + i] * 40,
            SamplingParams(temperature=1.0, seed=i, max_tokens=100, structured_outputs=S(json=PET)),
        )
        for i in range(6)
    }
    finals = run(small, requests)
    assert small.scheduler.num_preemptions > 0
    for out in finals.values():
        jsonschema.validate(json.loads(out.outputs[0].text), PET)


def test_logit_bias_moves_the_argmax_as_transformers_logits_say(engine, tiny_model_path):
    from transformers import AutoModelForCausalLM

    path = tiny_model_path("llama")
    prompt = [11, 22, 33, 44]
    hf = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    logits = hf(torch.tensor([prompt])).logits[0, -1]
    top2 = logits.topk(2).indices.tolist()
    bias = {top2[0]: -100.0}
    params = SamplingParams(temperature=0.0, max_tokens=1, logit_bias=bias)
    [out] = run(engine, {"b": (prompt, params)}).values()
    assert out.outputs[0].token_ids == [int((logits + _dense(bias, logits)).argmax())]
    assert out.outputs[0].token_ids == [top2[1]]
    forced = SamplingParams(temperature=1.0, max_tokens=5, logit_bias={"300": 100})
    [out] = run(engine, {"f": (prompt, forced)}).values()
    assert out.outputs[0].token_ids == [300] * 5


def _dense(bias: dict[int, float], like: torch.Tensor) -> torch.Tensor:
    dense = torch.zeros_like(like)
    for token, value in bias.items():
        dense[token] = value
    return dense


FIELD = st.sampled_from(
    [
        {"type": "integer", "minimum": -5, "maximum": 500},
        {"type": "boolean"},
        {"type": "string", "maxLength": 5},
        {"enum": ["a", "b", 3, None]},
        {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 4},
        {"type": "number", "minimum": 0, "maximum": 10},
        {"anyOf": [{"type": "null"}, {"type": "string", "maxLength": 3}]},
    ]
)


@settings(max_examples=8, deadline=None)
@given(
    fields=st.dictionaries(st.from_regex(r"[a-z]{1,6}", fullmatch=True), FIELD, max_size=4),
    seed=st.integers(0, 2**32),
)
def test_random_schemas_give_valid_json(engine, fields, seed):
    schema = {
        "type": "object",
        "properties": fields,
        "required": sorted(fields),
        "additionalProperties": False,
    }
    params = SamplingParams(
        temperature=1.0, seed=seed, max_tokens=200, structured_outputs=S(json=schema)
    )
    [out] = run(engine, {"h": ("Random", params)}).values()
    assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
    jsonschema.validate(json.loads(out.outputs[0].text), schema)
