"""An audit verification job, as the gateway keeps it in Redis (``Keys.audit_verify``,
a hash: job id -> this record's JSON; ``latest:<mode>`` -> the newest job of a mode;
``verified`` -> the newest checkpoint a job verified).

``POST /v1/audit/verify`` starts one (``gateway/audit_jobs.py``) and any gateway
replica answers ``GET /v1/audit/verify/{id}`` from here. The replica that runs it
updates it every second; one that stopped updating for :data:`LOST_AFTER_S` is
reported ``lost``, and the next full job resumes from the position it reached.

May import: the standard library and orjson.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, fields

import orjson

MODES = ("incremental", "full")
STATUSES = ("running", "succeeded", "failed", "lost")
LOST_AFTER_S = 30.0


@dataclass
class Verification:
    """One verification job: what it walks, how far it got, what it found."""

    id: str
    mode: str  # one of MODES: from the newest verified checkpoint, or every row
    status: str  # "running", "succeeded" or "failed" ("lost" is read, never stored)
    started_at: float
    updated_at: float
    finished_at: float | None = None
    since_checkpoint: int | None = None  # incremental: the checkpoint it walks from
    resumed_from: int | None = None  # full: the position a lost job had reached
    rows_walked: int = 0
    rows_total: int = 0
    position: int = 0  # the chain position the walk has reached
    position_hash: str | None = None  # that row's hash (where a resumed walk goes on)
    ok: bool | None = None
    failure: str | None = None
    head_seq: int | None = None
    head_hash: str | None = None
    checkpoints: int | None = None
    verified_checkpoint: int | None = None
    archived_rows: int | None = None

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, not {self.mode!r}")

    def current_status(self, now: float | None = None) -> str:
        now = time.time() if now is None else now
        if self.status == "running" and now - self.updated_at > LOST_AFTER_S:
            return "lost"
        return self.status

    @property
    def done(self) -> bool:
        return self.status in ("succeeded", "failed")

    def public(self, now: float | None = None) -> dict:
        """The job as ``/v1/audit/verify`` shows it (``position_hash`` left out)."""
        shown = asdict(self)
        del shown["position_hash"]
        return {"object": "audit.verification", **shown, "status": self.current_status(now)}

    def to_json(self) -> bytes:
        return orjson.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: bytes | str) -> Verification:
        data = orjson.loads(raw)
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})
