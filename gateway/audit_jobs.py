"""Audit verification as a job: ``POST /v1/audit/verify`` starts one and answers at
once; the walk runs in a thread of the gateway that took the request, which writes
its progress to Redis every second (``lifecycle/audit_verification.py``), so any
replica answers ``GET /v1/audit/verify/{id}``. No request ever walks the chain.

``incremental`` walks the rows after the newest checkpoint a job verified (every
checkpoint is still checked); ``full`` walks every row, and goes on from where a
lost full job (its gateway stopped) got to. One job of a mode runs at a time: asking
again while one runs answers with that one.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from typing import Any

from lorapool.lifecycle.audit_verification import Verification
from lorapool.lifecycle.keys import Keys

log = logging.getLogger(__name__)
PROGRESS_EVERY_S = 1.0
KEEP_JOBS = 50  # the hash keeps about this many finished jobs
VERIFIED = "verified"


class VerifyJobs:
    """Verification jobs of one audit database (``engine``), kept in ``redis``."""

    def __init__(self, engine, redis, keys: Keys):
        self.engine, self.redis, self.key_name = engine, redis, keys.audit_verify
        self._lock = threading.Lock()

    # --- reading -------------------------------------------------------------------

    def get(self, job_id: str) -> Verification | None:
        raw = self.redis.hget(self.key_name, job_id)
        return None if raw is None else Verification.from_json(raw)

    def latest(self, mode: str) -> Verification | None:
        job_id = self.redis.hget(self.key_name, f"latest:{mode}")
        return None if job_id is None else self.get(job_id.decode())

    # --- starting ------------------------------------------------------------------

    def start(self, mode: str, key: bytes) -> tuple[Verification, bool]:
        """A running job of ``mode`` (joined), or a new one; True when it is new."""
        with self._lock:
            latest = self.latest(mode)
            if latest is not None and latest.current_status() == "running":
                return latest, False
            job = self._new(mode, latest)
            self._save(job)
            self.redis.hset(self.key_name, f"latest:{mode}", job.id)
        self._prune()
        thread = threading.Thread(target=self._run, args=(job, key), daemon=True)
        thread.name = f"audit-verify-{job.id}"
        thread.start()
        return job, True

    def _new(self, mode: str, latest: Verification | None) -> Verification:
        now = time.time()
        job = Verification(uuid.uuid4().hex, mode, "running", now, now)
        if mode == "incremental":
            verified = self.redis.hget(self.key_name, VERIFIED)
            job.since_checkpoint = int(verified) if verified else None
        elif latest is not None and latest.current_status() == "lost" and latest.position_hash:
            job.resumed_from = latest.position
            job.position, job.position_hash = latest.position, latest.position_hash
        return job

    # --- running -------------------------------------------------------------------

    def _run(self, job: Verification, key: bytes) -> None:
        from lorapool.audit_db.verify import verify_chain

        last = [0.0]

        def progress(walk, total: int) -> None:
            job.rows_walked, job.rows_total = walk.num_rows, total
            if walk.first_bad is None:
                job.position, job.position_hash = walk.seq, walk.row_hash
            if time.monotonic() - last[0] >= PROGRESS_EVERY_S:
                last[0] = time.monotonic()
                self._save(job)

        resume = (job.position, job.position_hash) if job.resumed_from is not None else None
        try:
            report = verify_chain(
                self.engine, key, since=job.since_checkpoint, resume=resume, progress=progress
            )
        except Exception as exc:  # the database went away, a checkpoint vanished, ...
            log.exception("audit verification %s failed", job.id)
            self._finish(job, ok=False, failure=f"verification could not finish: {exc}")
            return
        self._finish(job, ok=report.ok, failure=report.describe_failure() or None, report=report)

    def _finish(self, job: Verification, ok: bool, failure: str | None, report=None) -> None:
        job.ok, job.failure = ok, failure
        job.status = "succeeded" if ok else "failed"
        if report is not None:
            job.head_seq, job.head_hash = report.head_seq, report.head_hash
            job.checkpoints, job.archived_rows = report.num_checkpoints, report.archived_rows
            point = report.verified_checkpoint
            job.verified_checkpoint = point.id if point is not None else None
            if ok and point is not None:
                self.redis.hset(self.key_name, VERIFIED, point.id)
        job.finished_at = time.time()
        self._save(job)

    def _save(self, job: Verification) -> None:
        job.updated_at = time.time()
        self.redis.hset(self.key_name, job.id, job.to_json())

    def _prune(self) -> None:
        """Drop the oldest finished jobs beyond :data:`KEEP_JOBS`."""
        entries: dict[Any, Any] = self.redis.hgetall(self.key_name)
        jobs = []
        for field, raw in entries.items():
            if b":" in field or field == VERIFIED.encode():
                continue
            job = Verification.from_json(raw)
            if job.done:
                jobs.append((job.started_at, field))
        old = [field for _at, field in sorted(jobs)[:-KEEP_JOBS]]
        if old:
            self.redis.hdel(self.key_name, *old)
