"""The seeds' examples 1 to 7 (seeds/002, RequestOutput_lora) with imports and paths changed.

Each example body is the seed's code; only the imports (``vllm`` -> ``lorapool``), the
model (a tiny model) and the adapter paths (PEFT adapters built here) differ.
"""

import json
from collections import defaultdict
from datetime import datetime

import pytest
from adapters import build_adapter

from lorapool import EngineArgs, LLMEngine, LoRARequest, SamplingParams


@pytest.fixture(scope="module")
def paths(model, tmp_path_factory):
    root = tmp_path_factory.mktemp("seed-adapters")
    names = ["sql-lora", "python-lora", "cpp-lora", "java-lora", "creative-lora", "compliance-lora"]
    return {
        name: str(build_adapter(model, root / name, rank=8 + 4 * (i % 2), seed=i))
        for i, name in enumerate(names)
    }


def test_example_1_basic_output(model, paths, capsys):
    engine_args = EngineArgs(model=model, enable_lora=True, max_lora_rank=64)
    engine = LLMEngine.from_engine_args(engine_args)
    lora_request = LoRARequest("sql-lora", 1, paths["sql-lora"])
    sampling_params = SamplingParams(temperature=0.0, max_tokens=128)
    engine.add_request("req-1", "SQL query prompt", sampling_params, lora_request=lora_request)
    while engine.has_unfinished_requests():
        outputs = engine.step()
        for output in outputs:
            if output.finished:
                if output.lora_request:
                    print(f"Adapter: {output.lora_request.name}")
                    print(f"Adapter ID: {output.lora_request.adapter_id}")
                else:
                    print("Used base model")
                print(f"Generated: {output.outputs[0].text}")
    assert "Adapter: sql-lora\nAdapter ID: 1\n" in capsys.readouterr().out


def test_example_2_comparing_adapters(model, paths):
    engine_args = EngineArgs(model=model, enable_lora=True, max_loras=3, max_lora_rank=64)
    engine = LLMEngine.from_engine_args(engine_args)
    prompt = "Write a function to calculate factorial"
    sampling_params = SamplingParams(temperature=0.0, max_tokens=128)
    adapters = [
        LoRARequest("python-lora", 1, paths["python-lora"]),
        LoRARequest("cpp-lora", 2, paths["cpp-lora"]),
        LoRARequest("java-lora", 3, paths["java-lora"]),
    ]
    for i, lora_req in enumerate(adapters):
        engine.add_request(f"req-{i}", prompt, sampling_params, lora_request=lora_req)
    results = {}
    while engine.has_unfinished_requests():
        outputs = engine.step()
        for output in outputs:
            if output.finished:
                adapter_name = output.lora_request.name
                results[adapter_name] = output.outputs[0].text
    assert sorted(results) == ["cpp-lora", "java-lora", "python-lora"]
    assert len(set(results.values())) == 3


def test_example_3_metrics_per_adapter(model, paths):
    engine_args = EngineArgs(model=model, enable_lora=True, max_loras=2)
    engine = LLMEngine.from_engine_args(engine_args)
    adapter_metrics = defaultdict(lambda: {"count": 0, "total_tokens": 0})
    lora_request = LoRARequest("sql-lora", 1, paths["sql-lora"])
    sampling_params = SamplingParams(max_tokens=128)
    for i in range(10):
        engine.add_request(f"req-{i}", f"Prompt {i}", sampling_params, lora_request=lora_request)
    while engine.has_unfinished_requests():
        outputs = engine.step()
        for output in outputs:
            if output.finished:
                adapter_name = output.lora_request.name if output.lora_request else "base"
                adapter_metrics[adapter_name]["count"] += 1
                for completion in output.outputs:
                    adapter_metrics[adapter_name]["total_tokens"] += len(completion.token_ids)
    assert adapter_metrics["sql-lora"]["count"] == 10
    assert adapter_metrics["sql-lora"]["total_tokens"] > 0


def test_example_4_streaming(model, paths):
    engine_args = EngineArgs(model=model, enable_lora=True)
    engine = LLMEngine.from_engine_args(engine_args)
    lora_request = LoRARequest("sql-lora", 1, paths["sql-lora"])
    sampling_params = SamplingParams(max_tokens=128)
    engine.add_request("stream-req", "Long SQL query", sampling_params, lora_request=lora_request)
    num_partial = 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        for output in outputs:
            if output.lora_request:
                assert output.lora_request.name == lora_request.name
            assert output.lora_request is lora_request
            num_partial += not output.finished
    assert num_partial > 0


def test_example_5_multi_sampling(model, paths):
    engine_args = EngineArgs(model=model, enable_lora=True)
    engine = LLMEngine.from_engine_args(engine_args)
    lora_request = LoRARequest("creative-lora", 1, paths["creative-lora"])
    sampling_params = SamplingParams(n=5, temperature=0.8, max_tokens=128)
    engine.add_request("multi-sample", "Write a story", sampling_params, lora_request=lora_request)
    finished = []
    while engine.has_unfinished_requests():
        outputs = engine.step()
        for output in outputs:
            if output.finished:
                finished.append(output)
                for completion in output.outputs:
                    assert completion.lora_request.name == lora_request.name
    assert len(finished) == 1 and len(finished[0].outputs) == 5


def test_example_6_error_output_carries_its_adapter(model, tmp_path, capsys):
    engine_args = EngineArgs(model=model, enable_lora=True)
    engine = LLMEngine.from_engine_args(engine_args)
    lora_request = LoRARequest("experimental-lora", 1, str(tmp_path / "experimental-lora"))
    sampling_params = SamplingParams(max_tokens=128)
    engine.add_request("test-req", "Test prompt", sampling_params, lora_request=lora_request)
    try:
        while engine.has_unfinished_requests():
            outputs = engine.step()
            for output in outputs:
                if output.finished:
                    if output.outputs[0].finish_reason == "error":
                        adapter_info = (
                            f"with adapter {output.lora_request.name}"
                            if output.lora_request
                            else "with base model"
                        )
                        print(f"Generation failed {adapter_info}")
                    else:
                        print(f"Success: {output.outputs[0].text}")
    except Exception as e:
        print(f"Error during inference: {e}")
        if hasattr(e, "lora_request"):
            print(f"Failed adapter: {e.lora_request.name}")
    assert "Generation failed with adapter experimental-lora" in capsys.readouterr().out


def test_example_7_audit_trail(model, paths, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    engine_args = EngineArgs(model=model, enable_lora=True)
    engine = LLMEngine.from_engine_args(engine_args)
    audit_log = []
    lora_request = LoRARequest("compliance-lora", 1, paths["compliance-lora"])
    sampling_params = SamplingParams(max_tokens=128)
    engine.add_request("audit-req-1", "Sensitive query", sampling_params, lora_request=lora_request)
    while engine.has_unfinished_requests():
        outputs = engine.step()
        for output in outputs:
            if output.finished:
                audit_record = {
                    "timestamp": datetime.now().isoformat(),
                    "request_id": output.request_id,
                    "prompt": output.prompt,
                    "response": output.outputs[0].text,
                    "adapter_name": output.lora_request.name if output.lora_request else None,
                    "adapter_id": output.lora_request.adapter_id if output.lora_request else None,
                    "adapter_path": output.lora_request.path if output.lora_request else None,
                    "finish_reason": output.outputs[0].finish_reason,
                }
                audit_log.append(audit_record)
    with open("audit_log.json", "w") as f:
        json.dump(audit_log, f, indent=2)
    record = json.loads((tmp_path / "audit_log.json").read_text())[0]
    assert record["adapter_name"] == "compliance-lora" and record["adapter_id"] == 1
    assert record["adapter_path"] == paths["compliance-lora"]
