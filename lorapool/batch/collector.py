"""The collector: each line's final output, in input order, into the output file
(status 200) or the error file (a failed request, or a line a cancel or the
completion window stopped), in OpenAI's output line shape:

    {"id", "custom_id", "response": {"status_code", "request_id", "body"} | null,
     "error": {"code", "message"} | null}

It reads each job's final result through its handle (the chunk log, or the compacted
record in the job's hash), so a collector that is restarted writes the same files.
"""

from __future__ import annotations

import time
from typing import Any

from lorapool.batch.files import FileStore, LineWriter
from lorapool.batch.lines import BatchLine, read_lines
from lorapool.batch.state import USAGE, BatchState, Status
from lorapool.openai.serving import answer, echo_of, shape_of
from lorapool.outputs import RequestOutput
from lorapool.producer import Producer

STOPPED = {Status.CANCELLING: "batch_cancelled", Status.EXPIRED: "batch_expired"}


class Collector:
    """Collects one batch; ``run`` returns its final status."""

    def __init__(
        self, producer: Producer, state: BatchState, files: FileStore, batch_id: str, poll_s: float
    ):
        self.producer, self.state, self.files = producer, state, files
        self.batch_id, self.poll_s = batch_id, poll_s
        self.batch = state.get(batch_id)
        self.stopped: str | None = None  # the error code of lines a stop left unrun

    def run(self) -> Status:
        tenant = self.state.owner(self.batch_id).get("tenant") or ""
        output = self.files.writer(f"{self.batch_id}_output.jsonl", owner=tenant)
        errors = self.files.writer(f"{self.batch_id}_error.jsonl", owner=tenant)
        self.state.set(self.batch_id, completed=0, failed=0, **dict.fromkeys(USAGE, 0))
        try:
            for line in read_lines(self._input(), self.batch_id, self.producer.limits):
                record, ok = self._collect(line)
                (output if ok else errors).write(record)
                usage = _usage(record) if ok else None
                self.state.count(self.batch_id, int(ok), int(not ok), usage)
        except BaseException:
            output.discard()
            errors.discard()
            raise
        return self._finish(output, errors)

    def _input(self):
        return self.files.lines(self.batch["input_file_id"])

    def _finish(self, output: LineWriter, errors: LineWriter) -> Status:
        self.state.move(self.batch_id, Status.FINALIZING, Status.IN_PROGRESS)
        files = {"output_file_id": output.finish()["id"] if output.count else None}
        files["error_file_id"] = errors.finish()["id"] if errors.count else None
        self.state.set(self.batch_id, **{k: v for k, v in files.items() if v})
        for writer in (output, errors):
            if not writer.count:
                writer.discard()
        final = {
            None: Status.COMPLETED,
            "batch_cancelled": Status.CANCELLED,
            "batch_expired": Status.EXPIRED,
        }[self.stopped]
        self.state.move(self.batch_id, final, Status.FINALIZING, Status.CANCELLING)
        return final

    def _collect(self, line: BatchLine) -> tuple[dict[str, Any], bool]:
        rid = line.request_id(self.batch_id)
        output = self._wait(rid)
        if output is None or output.outputs and output.outputs[0].finish_reason == "abort":
            code = self.stopped or "batch_cancelled"
            message = f"the batch stopped ({code}) before this request finished"
            return self._line(line, None, {"code": code, "message": message}), False
        parsed = line.parsed
        shape = shape_of(line.kind, parsed, rid, echo=echo_of(parsed), named=False)
        body, status = answer(shape, [output])
        response = {"status_code": status, "request_id": rid, "body": body}
        return self._line(line, response, None), status == 200

    def _line(self, line: BatchLine, response: Any, error: Any) -> dict[str, Any]:
        rid = line.request_id(self.batch_id)
        return {"id": f"batch_req_{rid}", "custom_id": line.custom_id, "response": response,
                "error": error}  # fmt: skip

    def _wait(self, rid: str) -> RequestOutput | None:
        """The final output of ``rid``; None when the batch stopped before it was sent."""
        handle = self.producer.handle(rid)
        self._check_stop()
        while True:
            if self.stopped is not None and handle.status() is None:
                return None
            try:
                return handle.result(timeout=self.poll_s)
            except TimeoutError:
                self._check_stop()

    def _check_stop(self) -> None:
        """On a cancel or past the window: abort every line still to run, once."""
        if self.stopped is not None:
            return
        status = self.state.status(self.batch_id)
        if status != Status.CANCELLING and time.time() >= self.batch["expires_at"]:
            status = Status.EXPIRED
        if status in STOPPED:
            self.stopped = STOPPED[status]
            for line in read_lines(self._input(), self.batch_id, self.producer.limits):
                self.producer.abort(line.request_id(self.batch_id))


def _usage(record: dict[str, Any]) -> dict[str, int]:
    """A collected line's tokens, from its response's ``usage``."""
    usage = record["response"]["body"].get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    return {
        "input_tokens": usage.get("prompt_tokens", 0),
        "output_tokens": usage.get("completion_tokens", 0),
        "cached_tokens": details.get("cached_tokens", 0),
    }
