"""``bench records``' slotted-dataclass candidate (benchmarks/records.py):
``to_wire``/``from_wire`` by hand with orjson."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson
from records_cases import LORA, METRICS

from lorapool.outputs import CompletionOutput


@dataclass(slots=True)
class DDelta:
    text: str
    token_ids: list[int]
    index: int = 0
    offset: int = 0
    logprobs: list | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def to_wire(self, chunk_offset: int) -> dict[str, Any]:
        record: dict[str, Any] = {"t": self.text, "k": self.token_ids}
        if self.index:
            record["i"] = self.index
        if self.offset != chunk_offset:
            record["o"] = self.offset
        for key, value in (
            ("l", self.logprobs),
            ("c", self.cumulative_logprob),
            ("f", self.finish_reason),
            ("r", self.stop_reason),
        ):
            if value is not None:
                record[key] = value
        return record

    @classmethod
    def from_wire(cls, r: dict[str, Any], chunk_offset: int) -> DDelta:
        text, ids = r["t"], r["k"]
        if not (isinstance(text, str) and isinstance(ids, list)):
            raise ValueError("bad completion text or ids")
        return cls(
            text,
            ids,
            r.get("i", 0),
            r.get("o", chunk_offset),
            r.get("l"),
            r.get("c"),
            r.get("f"),
            r.get("r"),
        )


def dataclass_encode(c: CompletionOutput, final: bool) -> bytes:
    delta = DDelta(
        c.text, list(c.token_ids), c.index, 5, None, c.cumulative_logprob, c.finish_reason
    )
    record: dict[str, Any] = {"s": 95 if final else 5, "o": 5, "c": [delta.to_wire(5)]}
    if final:
        record["f"] = 1
    record["a"] = LORA.lora_int_id
    if final:
        record["lora"], record["m"] = LORA.to_dict(), METRICS.to_dict()
        record["w"] = "worker-1"
    return orjson.dumps(record)


def dataclass_decode(raw: bytes) -> Any:
    data = orjson.loads(raw)
    offset = data.get("o", 0)
    return [DDelta.from_wire(r, offset) for r in data["c"]], data
