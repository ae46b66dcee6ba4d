"""HTTP helpers of the gateway's job tests: submit, poll to a final status, read events."""

from __future__ import annotations

import time

import httpx
import orjson


def submit(gateway: str, body: dict, **headers) -> httpx.Response:
    return httpx.post(f"{gateway}/v1/jobs", json=body, headers=headers, timeout=30)


def poll(gateway: str, job_id: str, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        job = httpx.get(f"{gateway}/v1/jobs/{job_id}", timeout=30).json()
        if job["status"] not in ("queued", "running"):
            return job
        assert time.monotonic() < deadline, job
        time.sleep(0.1)


def read_events(gateway: str, job_id: str, last_event_id: str | None = None) -> list:
    """(event id, event name, data) of every event until the server ends the stream."""
    headers = {} if last_event_id is None else {"Last-Event-ID": last_event_id}
    events, current = [], {}
    with httpx.stream(
        "GET", f"{gateway}/v1/jobs/{job_id}/events", headers=headers, timeout=120
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if not line:
                if "data" in current:
                    events.append((current.get("id"), current.get("event"), current["data"]))
                current = {}
                continue
            field, _, value = line.partition(": ")
            current[field] = orjson.loads(value) if field == "data" else value
    return events
